"""The root helper's trust (runs as root, from install-agent.sh as ``llmgw agent
update-trust``): the cluster CA that signed update orders must verify against, and the node
id they must name, in a directory only root writes (``/etc/llmgw/update``).

The CA is written there only when its public key hashes to a pin the operator gave
(``--ca-hash`` of an install or rekey) or the one recorded at the first install, never on
the agent's word: the agent's copy of the CA is just a candidate. The pin names a key, and a
certificate carrying that key can be made by anyone: only a CA certificate (basic
constraints) that is self-issued and whose signature that very key made is trusted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw.contracts.update_order import MAX_SMALL
from llmgw.errors import UpdateError
from llmgw.fsutil import atomic_write
from llmgw.pki import fingerprint, is_ca_certificate, issued_by
from llmgw.updater.nofollow import OPEN_DIR, NotPlain, read_plain

__all__ = ["DEFAULT_TRUST", "TRUST_CA", "TRUST_NODE_ID", "TRUST_PIN", "install_trust"]

DEFAULT_TRUST = Path("/etc/llmgw/update")
TRUST_CA = "ca.pem"
TRUST_NODE_ID = "node-id"
# The pin (sha256:<hex> of the CA's public key) the trusted CA was checked against: the
# operator's --ca-hash of the first install, rewritten only by a root-run install or rekey
# that passes a pin of its own.
TRUST_PIN = "ca-hash"

_PIN = re.compile(r"sha256:[0-9a-f]{64}")


def install_trust(ca_file: Path, trust: Path = DEFAULT_TRUST, pin: str | None = None) -> bool:
    """Make ``trust/ca.pem`` (what the root helper checks orders against) the CA in
    ``ca_file``, but only when that CA's public key hashes to the pin: ``pin`` (the
    operator's --ca-hash), else the one recorded in ``trust/ca-hash`` at the first install,
    else that of the ca.pem already trusted. With none of them nothing is written. True when
    ca.pem (or the recorded pin) changed, False when it was so already; UpdateError, the trust
    left as it was, when the CA does not match or cannot be read.

    The installer passes a root-owned copy that it had the agent user read from the agent's
    state directory (so a symlink planted there reaches only what the agent may read); here
    ``ca_file`` and everything under ``trust`` are opened without following a symlink.
    ``ca_file`` may hold several certificates (the agent's trust bundle across a CA
    rotation): only the CA whose key hashes to the pin is written.

    CA rotation keeps to this rule: a new CA reaches the helper either by this root-run verb
    with the new CA's pin (an install, upgrade or rekey with --ca-hash records it), or by an
    order that verifies under the CA trusted now and names the new CA's pin
    (:func:`llmgw.contracts.update_order.trust_move`), which the helper passes here as
    ``pin`` (:mod:`llmgw.updater.apply`); never by the agent alone."""
    bundle = _read_trust_input(ca_file)
    try:
        certs = x509.load_pem_x509_certificates(bundle)
    except ValueError as exc:
        raise UpdateError(
            f"{ca_file} is not a PEM certificate ({exc}); the update helper keeps its trust. "
            "Run the install again with --ca-hash from 'llmgw ctl join-command'",
            state="refused",
        ) from None
    # The agent's CA file is a trust bundle across a CA rotation: the pin picks one of it.
    cas = [c for c in certs if is_ca_certificate(c)]
    if not cas:
        raise UpdateError(
            f"{ca_file} is not a CA certificate; the update helper keeps its trust",
            state="refused",
        )
    try:
        trust_fd = os.open(trust, OPEN_DIR)
    except OSError as exc:
        raise UpdateError(
            f"cannot open {trust} (a directory of root's, never a symlink): "
            f"{exc.strerror}; run the installer as root",
            state="failed",
        ) from None
    try:
        recorded = _read_trust_file(trust_fd, TRUST_PIN).decode("ascii", "replace").strip()
        trusted = _read_trust_file(trust_fd, TRUST_CA)
        wanted = pin.strip().lower() if pin else ""
        source = "the --ca-hash given"
        if not wanted and recorded:
            wanted, source = recorded, f"the pin recorded in {trust / TRUST_PIN}"
        if not wanted and trusted:
            try:
                wanted = fingerprint(x509.load_pem_x509_certificate(trusted).public_key())
            except ValueError:
                wanted = ""
            source = f"the CA trusted now ({trust / TRUST_CA})"
        if not wanted:
            raise UpdateError(
                f"no pin to check {ca_file} against: the update helper gets no trusted CA. "
                "Run the install again with --ca-hash from 'llmgw ctl join-command'",
                state="refused",
            )
        if not _PIN.fullmatch(wanted):
            raise UpdateError(
                f"the pin {wanted[:80]!r} ({source}) is not sha256:<64 hex digits>; give "
                "--ca-hash from 'llmgw ctl join-command'",
                state="refused",
            )
        by_pin: dict[str, list[x509.Certificate]] = {}
        for c in cas:
            by_pin.setdefault(fingerprint(c.public_key()), []).append(c)
        if wanted not in by_pin:
            got = ", ".join(by_pin)
            raise UpdateError(
                f"the CA in {ca_file} has the hash {got}, not {wanted} ({source}); the update "
                "helper keeps the CA it trusts. If the cluster CA really changed, rekey the "
                "node with the new --ca-hash ('llmgw ctl join-command --rekey NODE')",
                state="refused",
            )
        # The pin names a key, which anyone may put in a certificate of their own making:
        # only the CA's own certificate (self-issued, signed by that very key) is trusted.
        cert = next((c for c in by_pin[wanted] if issued_by(c, c)), None)
        if cert is None:
            raise UpdateError(
                f"the certificate in {ca_file} with the key {wanted} ({source}) is not the CA's "
                "own: it is not self-issued, or its signature is not made by that key (a "
                "cross-certificate, or one made to pass for the CA); the update helper keeps "
                "the CA it trusts. Give the cluster CA's ca.crt",
                state="refused",
            )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        changed = False
        if trusted != cert_pem:
            atomic_write(TRUST_CA, cert_pem, mode=0o644, dir_fd=trust_fd)
            changed = True
        if recorded != wanted:
            atomic_write(TRUST_PIN, (wanted + "\n").encode(), mode=0o644, dir_fd=trust_fd)
            changed = True
        return changed
    finally:
        os.close(trust_fd)


def _read_trust_input(path: Path) -> bytes:
    try:
        return read_plain(path, limit=MAX_SMALL)
    except NotPlain as exc:
        if exc.reason == "a symlink":
            why = "it is a symlink"
        else:
            why = f"it is {exc.reason}; the CA must be a regular file of at most {MAX_SMALL} bytes"
    except OSError as exc:
        why = exc.strerror or str(exc)
    raise UpdateError(
        f"cannot read the CA {path} ({why}); the update helper keeps its trust", state="refused"
    )


def _read_trust_file(dir_fd: int, name: str) -> bytes:
    """A file of the trust directory; b"" when missing or not a regular file. Never through a
    symlink."""
    try:
        return read_plain(name, limit=MAX_SMALL, dir_fd=dir_fd)
    except FileNotFoundError:
        return b""
    except NotPlain as exc:
        if exc.reason == "not a regular file":
            return b""
        why = exc.reason
    except OSError as exc:
        why = exc.strerror or str(exc)
    raise UpdateError(
        f"cannot read {name} in the update trust directory: {why}; remove it and run the "
        "installer again",
        state="failed",
    )
