"""The one error hierarchy of llmgw; library code raises these, only the CLI prints them.

    LlmgwError                      base; ``exit_code`` 1, ``retryable`` False
    ├── ConfigError                 a config file or option is wrong (exit 2); names key and file
    ├── StartupError                a daemon's start-up step failed; names the step, carries the cause
    ├── PKIError                    certificates and keys
    │   ├── NoAuthority             no CA where one was expected
    │   ├── CertificateError        a certificate is unreadable, expired or for someone else
    │   └── CAExportError           a CA export cannot be opened or imported (passphrase, file, clash)
    ├── StoreError                  the state store
    │   ├── NotFound                no such node / model / replica / key
    │   ├── Conflict                the change contradicts what is stored
    │   ├── StoreUnavailable        the database does not answer (retryable)
    │   └── Fenced                  a write of a leader another instance has replaced
    ├── StreamError                 the control-plane <-> agent stream (retryable)
    │   ├── IdentityMismatch        claimed node id differs from the certificate's CN (not retryable)
    │   └── StaleEpoch              an order from an epoch lower than one already accepted
    ├── EnrolmentError              joining a node; ``code`` names the refusal, ``status`` its HTTP code
    │   ├── PinMismatch             the control plane's CA is not the pinned one (token not sent)
    │   ├── TokenError              the join token is unknown, expired, used, revoked, or not for this
    │   └── CSRError                the certificate request is malformed, weak, or names another node
    ├── FileError                   a file cannot be written in place; names the file
    │   └── ArchiveError            an archive is unreadable or unsafe to unpack; ``code`` says which
    ├── ShardError                  starting or stopping an engine process
    ├── EngineError                 an engine's own arguments or behaviour
    ├── TokenizerError              a model's tokenizer or chat template cannot be loaded (retryable)
    │   └── ChatTemplateRefused     a chat template tried what its sandbox forbids (not run)
    ├── UpdateError                 a signed self-update refused or failed; ``state`` says which
    ├── PasswordError               the admin password is wrong or unacceptable
    ├── ClientError                 ``llmgw ctl`` talking to the control plane
    │   ├── ConnectError            nothing answered at any address tried (retryable)
    │   └── APIError                the control plane answered with an error
    ├── SshError                    running a script on another machine over ssh
    │   ├── HostKeyError            its host key is unknown or changed (never retried)
    │   ├── SshAuthError            ssh could not log in (user, key)
    │   ├── SudoPasswordRequired    sudo there wants a password (never typed through ssh)
    │   └── SshUnreachable          nothing answers ssh there yet (retryable)
    └── OnboardError                ``ctl onboard``: an install, join, approval or wait failed

Every message says what is wrong and then what to do about it.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Base of every error llmgw raises on purpose."""

    exit_code: int = 1
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(LlmgwError):
    """A configuration file, option or environment variable is invalid."""

    exit_code = 2

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None) -> None:
        where = ""
        if file and key:
            where = f"{file}: {key}: "
        elif file:
            where = f"{file}: "
        elif key:
            where = f"{key}: "
        super().__init__(where + message)
        self.key = key
        self.file = file


class StartupError(LlmgwError):
    """A daemon could not start: ``step`` names the start-up step that failed. The message
    is the cause's (what is wrong and what to do) after the step's name; the exit code and
    retryability are the cause's too."""

    def __init__(self, daemon: str, step: str, cause: LlmgwError | OSError) -> None:
        if isinstance(cause, LlmgwError):
            why = str(cause)
            self.exit_code = cause.exit_code
            self.retryable = cause.retryable
        else:
            # Steps translate the errors they expect into ours; this is one nobody foresaw.
            where = f"{cause.filename}: " if cause.filename else ""
            why = (
                f"{where}{cause.strerror or cause}; check that it exists and that the "
                f"{daemon}'s user may use it"
            )
        super().__init__(f"{daemon} start-up failed at {step!r}: {why}")
        self.daemon = daemon
        self.step = step
        self.cause = cause


class PKIError(LlmgwError):
    """Certificates, keys and the cluster CA."""


class NoAuthority(PKIError):
    """There is no CA in the directory that should hold one."""

    exit_code = 2

    def __init__(self, directory: str) -> None:
        super().__init__(f"no authority in {directory}; run 'llmgw ctl cert init-ca' first")
        self.directory = directory


class CertificateError(PKIError):
    """A certificate or key is unreadable, mismatched, or not for this purpose."""


class CAExportError(PKIError):
    """An export of the cluster CA (``ctl cert export-ca``) cannot be opened (a wrong
    passphrase, an altered or foreign file) or imported here (this instance has another CA
    or admin token)."""


class StoreError(LlmgwError):
    """The state store failed or refused a change."""


class NotFound(StoreError):
    """The named object does not exist."""


class Conflict(StoreError):
    """The change contradicts what is stored."""


class StoreUnavailable(StoreError):
    """The database does not answer (a PostgreSQL restart or fail-over): retry later."""

    retryable = True


class Fenced(StoreError):
    """A write of a leader whose epoch is no longer current: another instance took over."""


class StreamError(LlmgwError):
    """The Connect stream between agent and control plane broke or was refused."""

    retryable = True


class IdentityMismatch(StreamError):
    """The node id a stream claims is not the CN of its client certificate."""

    retryable = False


class StaleEpoch(StreamError):
    """An order carries an epoch lower than the highest the agent has accepted."""

    retryable = False


class EnrolmentError(LlmgwError):
    """A node could not join, or its join was refused; ``code`` is stable for scripts."""

    code: str = "enrolment_failed"
    status: int = 400

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class PinMismatch(EnrolmentError):
    """The CA the control plane presented does not match ``--ca-hash``."""

    code = "ca_pin_mismatch"


class TokenError(EnrolmentError):
    """The join or rekey token was refused."""

    code = "token_invalid"
    status = 403


class CSRError(EnrolmentError):
    """The certificate signing request was refused."""

    code = "csr_invalid"
    status = 400


class FileError(LlmgwError):
    """A file could not be written atomically (llmgw.fsutil); ``path`` names it."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ArchiveError(FileError):
    """An archive cannot be unpacked: ``code`` is ``unreadable`` (damaged, or no archive),
    ``unsafe`` (``member`` would escape the destination, or is of a forbidden kind; ``reason``
    says how), ``too_big``, ``too_many`` (members) or ``write_failed`` (the destination).
    Callers put it in their own words: an engine install, an update bundle."""

    def __init__(
        self, message: str, *, code: str, member: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.member = member
        self.reason = reason or message


class ShardError(LlmgwError):
    """An engine process could not be started, watched or stopped."""


class EngineError(LlmgwError):
    """An engine rejected its arguments or behaved unexpectedly."""


class TokenizerError(LlmgwError):
    """A model's tokenizer or chat template could not be read, fetched, checked or parsed;
    the gateway routes the model without its prompts' prefixes meanwhile, and tries again."""

    retryable = True


class ChatTemplateRefused(TokenizerError):
    """A model's chat template (third-party code) tried what Jinja's sandbox forbids (an
    attribute such as ``__class__``, changing a list): it was stopped, and the request it
    was rendering is refused as the engine's own rendering would refuse it."""

    retryable = False


class UpdateError(LlmgwError):
    """A signed self-update was refused (``state`` "refused": forged, replayed, expired,
    downgrading, for another node) or could not be carried out (``state`` "failed")."""

    def __init__(self, message: str, *, state: str = "refused") -> None:
        super().__init__(message)
        self.state = state


class PasswordError(LlmgwError):
    """The admin password given is wrong, or a new one is not acceptable."""


class WeakPassword(PasswordError):
    """A new password that cannot be used (too short): the request's fault, not a wrong
    password."""


class ClientError(LlmgwError):
    """``llmgw ctl`` could not do what was asked of the control plane."""


class ConnectError(ClientError):
    """No control plane answered at any of the addresses tried."""

    retryable = True


class APIError(ClientError):
    """The control plane answered with an error status."""

    def __init__(self, message: str, *, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SshError(LlmgwError):
    """ssh to another machine failed, or what ran there did."""


class HostKeyError(SshError):
    """The machine's host key is not the one known_hosts pins (or none is pinned)."""


class SshAuthError(SshError):
    """ssh reached the machine but could not log in."""


class SudoPasswordRequired(SshError):
    """``sudo -n`` on the machine refused: it wants a password."""


class SshUnreachable(SshError):
    """Nothing answered ssh (refused, timed out, no route): a booting machine, perhaps."""

    retryable = True


class OnboardError(LlmgwError):
    """Onboarding a node over ssh failed at one of its steps; the message names it."""


__all__ = [
    "APIError",
    "ArchiveError",
    "CAExportError",
    "CSRError",
    "CertificateError",
    "ChatTemplateRefused",
    "ClientError",
    "ConfigError",
    "Conflict",
    "ConnectError",
    "EngineError",
    "EnrolmentError",
    "FileError",
    "HostKeyError",
    "IdentityMismatch",
    "LlmgwError",
    "NoAuthority",
    "NotFound",
    "OnboardError",
    "PKIError",
    "PasswordError",
    "PinMismatch",
    "ShardError",
    "SshAuthError",
    "SshError",
    "SshUnreachable",
    "StaleEpoch",
    "StartupError",
    "StoreError",
    "StreamError",
    "SudoPasswordRequired",
    "TokenError",
    "TokenizerError",
    "UpdateError",
    "WeakPassword",
]


class KvEventError(EngineError):
    """An engine's KV cache event (vLLM's format) could not be read."""
