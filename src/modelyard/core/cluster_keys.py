"""Redis keys the gateways and the leading controller share in cluster mode (one place, since
neither layer may import the other)."""

from __future__ import annotations

# `<prefix><gateway id>`: a gateway's counters per endpoint, JSON, expiring
# (`gateway/traffic_report.py`).
LOAD_PREFIX = "modelyard:load:"
# A set of endpoint ids a gateway wants a replica of (scale from zero); the leader drains it.
ACTIVATE_KEY = "modelyard:activate"
# The leading controller's URL (gateways forward control requests there), expiring, signed
# with the cluster secret (`cluster_auth.sign_leader_url`: `<hex HMAC> <url>`).
LEADER_KEY = "modelyard:controller:leader"
# `<prefix><endpoint id>:<version id>:<bucket>`: a hash of one version's outcomes at every
# gateway over one `OUTCOME_BUCKET_S` of wall-clock time (`core/outcome_counts.py`), expiring.
OUTCOMES_PREFIX = "modelyard:outcomes:"
# The replicas' prefix digests the leading controller shares with the gateways
# (`control/digest_publisher.py`, `gateway/digest_mirror.py`): a hash of `<endpoint id>/<replica
# id>` -> `<generation> <keys in base64>` (`prefix_keys.share_digest`), and a hash of the same
# fields -> a short hash of that value (what a gateway compares before fetching), both expiring.
DIGESTS_KEY = "modelyard:prefix:digests"
DIGEST_STAMPS_KEY = "modelyard:prefix:stamps"
