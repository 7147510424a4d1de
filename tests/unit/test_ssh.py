"""``llmgw.ssh``: the destination's syntax, the exact ssh command line (our safety options
first, never loosened), what ssh's failures become, and a script run through a stand-in ssh
that runs it with sh as a host would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.errors import (
    ConfigError,
    HostKeyError,
    SshAuthError,
    SshError,
    SshUnreachable,
    SudoPasswordRequired,
)
from llmgw.ssh import HostKey, RemoteRun, SshTarget, classify_failure, parse_destination


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("gpu-01", (None, "gpu-01", None)),
        ("root@10.0.0.5", ("root", "10.0.0.5", None)),
        ("ops@10.0.0.5:2222", ("ops", "10.0.0.5", 2222)),
        ("[fd00::5]:2200", (None, "fd00::5", 2200)),
        ("admin@fd00::5", ("admin", "fd00::5", None)),
    ],
)
def test_destinations(spec: str, parsed: tuple[str | None, str, int | None]) -> None:
    assert parse_destination(spec) == parsed


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("root@", "has no host"),
        ("ro ot@h", "is not a user name"),
        ("h:99999", "must be a number from 1 to 65535"),
        ("fd00::zz", "write an IPv6 address with a port as [::1]:22"),
        ("[gpu-01]:22", "is not an IPv6 address"),
    ],
)
def test_bad_destinations_are_refused(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r".*") as caught:
        parse_destination(spec)
    assert says in str(caught.value)


def test_the_command_line_puts_our_options_first() -> None:
    target = SshTarget(
        host="10.0.0.5",
        user="ops",
        port=2222,
        identity=Path("/keys/rack7"),
        options=("ProxyJump=bastion", "ConnectTimeout=30"),
    )
    assert target.argv("sh -s") == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "ConnectTimeout=15",
        "-T",
        "-p",
        "2222",
        "-i",
        "/keys/rack7",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "ProxyJump=bastion",
        "-o",
        "ConnectTimeout=30",
        "--",
        "ops@10.0.0.5",
        "sh -s",
    ]
    assert SshTarget(host="gpu-01").argv("x")[-3:] == ["--", "gpu-01", "x"]
    # Only where asked: an unknown key accepted (a changed one never), and ssh -v to read it.
    accepting = SshTarget(host="gpu-01", accept_new_host_key=True).argv("x", verbose=True)
    assert accepting[1:9] == [
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
        "-o", "ConnectTimeout=15", "-T", "-v",
    ]  # fmt: skip
    assert target.describe() == "ops@10.0.0.5:2222"
    assert SshTarget(host="fd00::5", port=22).describe() == "[fd00::5]:22"


@pytest.mark.parametrize(
    "option",
    ["StrictHostKeyChecking=accept-new", "stricthostkeychecking=no", "BatchMode=no"],
)
def test_options_that_would_loosen_ssh_are_refused(option: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SshTarget(host="h", options=(option,))
    assert "onboard always runs ssh so" in str(caught.value)


def test_an_option_must_be_key_value() -> None:
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        SshTarget(host="h", options=("-oProxyCommand",))


CHANGED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
Host key for 10.0.0.5 has changed and you have requested strict checking.
Host key verification failed.
"""
UNKNOWN = "No ED25519 host key is known for 10.0.0.5 and you have requested strict checking.\nHost key verification failed.\n"


@pytest.mark.parametrize("said", [CHANGED, UNKNOWN])
def test_a_host_key_refusal_says_how_to_pin_the_key(said: str) -> None:
    error = classify_failure(SshTarget(host="10.0.0.5", port=2222), said, sudo=False)
    assert isinstance(error, HostKeyError)
    assert not error.retryable
    text = str(error)
    assert "(Host key verification failed.)" in text
    assert "ssh-keyscan -p 2222 10.0.0.5" in text
    assert "ssh-keygen -R '[10.0.0.5]:2222'" in text
    if said is CHANGED:
        assert "a changed key is never accepted" in text and "--accept-new" not in text
    else:
        assert "let onboard accept an unknown key with --accept-new-host-key" in text


def test_other_failures() -> None:
    target = SshTarget(host="h", user="ops")
    refused = classify_failure(
        target, "ssh: connect to host h port 22: Connection refused\n", sudo=False
    )
    assert isinstance(refused, SshUnreachable) and refused.retryable
    assert "--wait-ssh 5m" in str(refused)
    denied = classify_failure(target, "ops@h: Permission denied (publickey).\n", sudo=False)
    assert isinstance(denied, SshAuthError) and not denied.retryable
    assert "authorized_keys" in str(denied)
    sudo = classify_failure(target, "sudo: a password is required\n", sudo=True)
    assert isinstance(sudo, SudoPasswordRequired)
    assert "NOPASSWD" in str(sudo) and "never types one" in str(sudo)
    other = classify_failure(target, "something odd\n", sudo=False)
    assert type(other) is SshError and "run ssh -v" in str(other)


# A stand-in ssh: it checks it got our options, records its argv, then behaves as the host
# named in $FAKE_SSH_HOSTS would: 'refuse' (ssh's exit 255), 'password' (sudo -n refuses),
# else it runs the remote command's script (stdin) with sh.
FAKE_SSH = r"""#!/bin/sh
printf '%s\n' "$@" >>"$FAKE_SSH_LOG"
[ "$2" = BatchMode=yes ] && [ "$4" = StrictHostKeyChecking=yes ] || { echo "bad options" >&2; exit 254; }
while [ "$1" != -- ]; do shift; done
dest=$2 remote=$3
host=${dest#*@}
case " ${FAKE_SSH_HOSTS:-} " in
    *" $host=refuse "*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
    *" $host=hostkey "*) echo "Host key verification failed." >&2; exit 255 ;;
    *" $host=dropped "*) echo "Connection to $host closed by remote host." >&2; exit 255 ;;
    *" $host=newkey "*)
        # What OpenSSH's ssh -v says of a jump host's key, then of the target's, then that
        # it added the target's (StrictHostKeyChecking=accept-new).
        echo "debug1: Server host key: ssh-ed25519 SHA256:jumpjumpjump" >&2
        echo "debug1: Server host key: ecdsa-sha2-nistp256 SHA256:targettarget" >&2
        echo "Warning: Permanently added '$host' (ECDSA) to the list of known hosts." >&2
        echo "debug1: Sending command: sh -s" >&2 ;;
esac
if [ "$remote" = "sudo -n sh -s" ]; then
    case " ${FAKE_SSH_HOSTS:-} " in
        *" $host=password "*) echo "sudo: a password is required" >&2; exit 1 ;;
    esac
fi
exec sh -s
"""


def fake_ssh(tmp_path: Path) -> Path:
    path = tmp_path / "ssh"
    path.write_text(FAKE_SSH)
    path.chmod(0o755)
    return path


def test_a_script_runs_from_stdin_and_its_lines_come_as_they_are_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "log"))
    target = SshTarget(host="h", ssh=str(fake_ssh(tmp_path)))
    seen: list[str] = []
    result = RemoteRun(target).run(
        "exec 2>&1\necho one\necho two >&2\nexit 7\n", timeout=30, on_line=seen.append
    )
    assert (result.returncode, result.output, seen) == (7, ["one", "two"], ["one", "two"])
    # The script was on stdin: the command line is only 'sh -s'.
    assert (tmp_path / "log").read_text().splitlines()[-1] == "sh -s"


def test_ssh_failures_become_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "log"))
    monkeypatch.setenv(
        "FAKE_SSH_HOSTS", "down=refuse moved=hostkey locked=password dropped=dropped"
    )
    ssh = str(fake_ssh(tmp_path))
    with pytest.raises(SshUnreachable):
        RemoteRun(SshTarget(host="down", ssh=ssh)).run("echo hi\n", timeout=30)
    with pytest.raises(HostKeyError):
        RemoteRun(SshTarget(host="moved", ssh=ssh)).run("echo hi\n", timeout=30)
    with pytest.raises(SudoPasswordRequired):
        RemoteRun(SshTarget(host="locked", ssh=ssh), sudo=True).run("echo hi\n", timeout=30)
    assert "sudo -n sh -s" in (tmp_path / "log").read_text().splitlines()
    # A session cut off under way (sshd restarting) is worth another try.
    with pytest.raises(SshUnreachable):
        RemoteRun(SshTarget(host="dropped", ssh=ssh)).run("echo hi\n", timeout=30)


def test_the_host_key_the_server_proved_is_read_from_ssh_v(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h=newkey")
    target = SshTarget(host="h", ssh=str(fake_ssh(tmp_path)))
    result = RemoteRun(target).run("echo hi\n", timeout=30, verbose=True)
    assert result.host_key == HostKey("ecdsa-sha2-nistp256", "SHA256:targettarget", added=True)
    # ssh's own debug lines are not what it "said".
    assert (
        result.ssh_stderr == "Warning: Permanently added 'h' (ECDSA) to the list of known hosts.\n"
    )
    assert result.output == ["hi"]


def test_a_script_that_does_not_end_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "log"))
    target = SshTarget(host="h", ssh=str(fake_ssh(tmp_path)))
    with pytest.raises(SshError, match="did not finish within 1s"):
        RemoteRun(target).run("exec sleep 30\n", timeout=1)


def test_no_ssh_client(tmp_path: Path) -> None:
    target = SshTarget(host="h", ssh=os.fspath(tmp_path / "missing"))
    with pytest.raises(SshError, match="apt-get install openssh-client"):
        RemoteRun(target).run("true\n", timeout=5)
