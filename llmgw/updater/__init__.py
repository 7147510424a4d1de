"""The root update helper: ``llmgw agent update-apply`` and ``llmgw agent update-trust``
(DESIGN §7). Everything in this package RUNS AS ROOT; it is kept apart from the agent and the
control plane so that it can be audited alone.

What it trusts: only what root alone can write. The cluster CA and this node's id in the
trust directory (``/etc/llmgw/update``, written by the installer; the CA only when it
matches the operator's pin: :mod:`llmgw.updater.trust`), and the last accepted counter in
its own state directory (``/var/lib/llmgw-update``, 0700). Everything in the agent's spool is
treated as hostile: the request is moved out of the agent's reach before it is read, and
nothing there is followed through a symlink (:mod:`llmgw.updater.nofollow`). An order is
applied only when it verifies against the trusted CA (:mod:`llmgw.contracts.update_order`)
and passes every check of :mod:`llmgw.updater.apply`; the bundle it names is checked,
unpacked and installed by :mod:`llmgw.updater.bundle`.

Its imports are the standard library, ``cryptography``, ``llmgw.errors``, the contracts
(``llmgw.contracts``) and the foundation modules (``llmgw.fsutil`` for atomic writes and
the safe unpack, ``llmgw.versions``, ``llmgw.netaddr``, and ``llmgw.pki`` for the CA's key
hash): nothing of ``llmgw.agent``, ``llmgw.server`` or ``llmgw.cli``
(tests/unit/test_imports.py walks them, transitively).
"""
