"""The cluster CA and the certificates it issues (ECDSA P-256, SHA-256).

Layout of a PKI directory (mode 0700)::

    ca.crt  ca.key            the cluster CA (key 0600)
    trust.crt                 what verifiers trust: the CA, and during a rotation the old one
    server.crt server.key     the control plane's TLS server certificate
    client.crt client.key     the control plane's client certificate (CN ``llmgw-control-plane``)

and during a CA rotation (see "CA rotation" below) ``previous-ca.crt``/``previous-ca.key``,
``ca-cross.crt`` and ``rotation.json``.

Node certificates carry CN = SAN DNS = node id and both clientAuth and serverAuth, because an
agent presents the same certificate to the control plane and on its own data plane.

**The control plane's identity.** Being issued by the cluster CA is not enough to act as the
control plane: a node is issued by it too, and a node id may look like any host name. Both
control-plane certificates (server and client) therefore carry what no node certificate can:

- the extended key usage :data:`CONTROL_PLANE_OID`, ``2.25.21242712681526740565347737651871607661``
  (an OID under the ``2.25`` arc of ITU-T X.667, derived from UUID
  ``0ffb3298-e281-4223-b680-f5913b09eb6d``: anyone may mint one there without registration,
  and no other body will ever assign this one);
- the DNS name :data:`CONTROL_PLANE_NAME` among their SANs, which :func:`validate_node_id`
  refuses as a node id.

Node certificates are built here from the node id alone (never from what a CSR asks for), and
:func:`check_csr` refuses a request that asks for that usage or a reserved name, so neither
can reach a node. Every client of the control plane checks one or the other: the agent's
stream pins the TLS name to :data:`CONTROL_PLANE_NAME` (the gRPC library cannot check an
extended key usage), the join client, the update download, the data plane, ``llmgw ctl`` and
a standby forwarding to the leader check the OID with :func:`control_plane_problem` once the
handshake is done (the last three through :mod:`llmgw.controlpeer`).

Every file is written atomically (llmgw.fsutil); private keys are created 0600 and are never
readable by anyone else, not even for an instant. Node ids and host names are checked by
llmgw.netaddr, which also knows this machine's addresses.

The package, by what each part does (every public name is re-exported here, where the rest
of llmgw imports it from):

- :mod:`~llmgw.pki.certs`: the shared shapes: file names, :class:`Authority`,
  :class:`Identity`, PEM in and out, fingerprints, SANs, the locked private directory;
- :mod:`~llmgw.pki.verify`: checking: the control plane's identity on a peer, who issued
  what, and what a node's certificate request may ask for;
- :mod:`~llmgw.pki.ca`: the CA: created, loaded, rotated, its rotation finished;
- :mod:`~llmgw.pki.issue`: issuing: node certificates (made here or from a CSR, one shape)
  and the control plane's own, (re)issued at each start.

The policy these share (the control plane's identity above, the one shape of a node
certificate) is written once: the identity in ``certs``/``verify``, the node shape in
``issue``.
"""

from llmgw.netaddr import CONTROL_PLANE_NAME
from llmgw.pki.ca import (
    CROSS_CERT,
    DEFAULT_OVERLAP,
    PREVIOUS_CA_CERT,
    PREVIOUS_CA_KEY,
    ROTATION_FILE,
    TRUST_BUNDLE,
    Rotation,
    cross_certificates,
    cross_sign,
    ensure_ca,
    finish_rotation,
    init_ca,
    load_ca,
    read_rotation,
    rotate_ca,
    rotation_json,
    trust_certificates,
    write_rotation,
)
from llmgw.pki.certs import (
    BACKDATE,
    CA_CERT,
    CA_KEY,
    CONTROL_PLANE_CN,
    CONTROL_PLANE_OID,
    DEFAULT_CA_CN,
    Authority,
    Identity,
    bundle_pem,
    cert_common_name,
    cert_pem,
    fingerprint,
    key_pem,
    load_bundle,
    load_cert,
    load_certs,
    new_private_key,
    serial_hex,
)
from llmgw.pki.issue import (
    ensure_server_identity,
    issue_control_plane_client_cert,
    issue_node_cert,
    issue_server_cert,
    sign_csr,
)
from llmgw.pki.verify import (
    MIN_RSA_BITS,
    check_csr,
    control_plane_names,
    control_plane_problem,
    is_ca_certificate,
    issued_by,
    load_csr,
    make_csr,
)

__all__ = [
    "BACKDATE",
    "CA_CERT",
    "CA_KEY",
    "CONTROL_PLANE_CN",
    "CONTROL_PLANE_NAME",
    "CONTROL_PLANE_OID",
    "CROSS_CERT",
    "DEFAULT_CA_CN",
    "DEFAULT_OVERLAP",
    "MIN_RSA_BITS",
    "PREVIOUS_CA_CERT",
    "PREVIOUS_CA_KEY",
    "ROTATION_FILE",
    "TRUST_BUNDLE",
    "Authority",
    "Identity",
    "Rotation",
    "bundle_pem",
    "cert_common_name",
    "cert_pem",
    "check_csr",
    "control_plane_names",
    "control_plane_problem",
    "cross_certificates",
    "cross_sign",
    "ensure_ca",
    "ensure_server_identity",
    "fingerprint",
    "finish_rotation",
    "init_ca",
    "is_ca_certificate",
    "issue_control_plane_client_cert",
    "issue_node_cert",
    "issue_server_cert",
    "issued_by",
    "key_pem",
    "load_bundle",
    "load_ca",
    "load_cert",
    "load_certs",
    "load_csr",
    "make_csr",
    "new_private_key",
    "read_rotation",
    "rotate_ca",
    "rotation_json",
    "serial_hex",
    "sign_csr",
    "trust_certificates",
    "write_rotation",
]
