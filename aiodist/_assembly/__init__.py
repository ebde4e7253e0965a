"""How ranks make worlds: joining one, agreeing on its members, dividing and changing it.

Holds a rank's way into a world (``_join``: namespace, transport, each backend's set-up),
what each rank joins and who arrived (``_forming``), the ``new_group`` vote
(``_subgroups``) and the successor worlds of ``shrink_group``, ``admit`` and
``join_process_group`` (``_membership``).

May import: everything below it (:mod:`aiodist.backends`, :mod:`aiodist.group`, the
transports, the stores, :mod:`aiodist._arrays`, :mod:`aiodist._util`, :mod:`aiodist.errors`),
never the API, the observation package or the facades above it.
"""
