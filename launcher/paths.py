"""Every path inside a pod directory that fractus-pod itself names, relative to the pod (the
ones a person configures are in fractus-pod.yaml), so no two modules disagree.
"""

from __future__ import annotations

CONFIG_NAME = "fractus-pod.yaml"
# `init` stages a new pod in a folder of this prefix, then moves it into place.
INIT_STAGING_PREFIX = ".fractus-pod-init-"

# ---- written by the workers ----------------------------------------------------------
def metrics_path(gpu: int) -> str:
    """The worker's METRICS file: JSON lines, the only thing the launcher reads of it."""
    return f"logs/metrics_gpu{gpu}.jsonl"


def worker_log_path(gpu: int) -> str:
    return f"logs/worker_gpu{gpu}.log"


def tensorboard_dir(gpu: int) -> str:
    """The GPU's TensorBoard run (`tensorboard --logdir logs/tb` shows one run per GPU)."""
    return f"logs/tb/gpu{gpu}"


# ---- written by the launcher ----------------------------------------------------------
EVENTS_FILE = "logs/events.jsonl"
LAUNCHER_LOG = "logs/launcher.log"   # a detached launcher's stdout and stderr
TENSORBOARD_RUN = "logs/tb/launcher"
TRACKIO_DIR = "logs/trackio"        # trackio's local store, when `tracker:` is set
INDEX_FILE = "logs/checkpoints.jsonl"
PASSED_DIR = "checkpoints/retained"
STATE_FILE = "logs/pod_state.json"
REQUEST_FILE = "logs/rollback_request.json"
STOP_REQUEST_FILE = "logs/stop_request.json"   # a stop for a launcher still starting
DECIDED_ROLLBACK_FILE = "logs/rollback_decided.json"   # a rollback decided, not yet carried out
LOCK_FILE = "logs/launcher.lock"
RESERVE_FILE = "logs/.launcher_reserve"
CANARY_FILE = "logs/canary.json"
CANARY_SCRATCH_DIR = "scratch/canary"   # never the canonical checkpoints
PROBE_DIR = "checkpoints/probe"
BASELINES_FILE = "logs/probe_baselines.json"   # stage -> gpu -> the AR recorded as baseline

# ---- merge rounds (launcher/hub/outer_step.py) ---------------------------------------
OUTER_STATE_FILE = "merge/outer_state.pt"        # the outer weights and momentum, last round
OUTER_STATE_PENDING = "merge/outer_state.next.pt"  # a round's outer state before its commit
MERGE_DIR = "merge/"                  # the merge rounds' files, all of them (MergeRounds')
ROUNDS_LEDGER = "merge/rounds.json"   # every round: quorum, verdict (the commit point), files
MERGE_INBOX_FILE = "merge/inbox.json"  # the newest round's decision, what the workers read


def merged_round_path(n: int) -> str:
    """Round n's merged weights, what the GPUs take."""
    return f"merge/round_{n:05d}.pt"


# ---- adoption of a reference-trainer run --------------------------------------------
ADOPTION_DIR = "checkpoints/adopted"
ADOPTED_MODEL_FILE = "manifests/adopted_model.json"
# The v1 run's own layout, as adoption finds it.
V1_MANIFESTS = ("checkpoints/RESUME_MANIFEST_8GPU.json", "RESUME_MANIFEST.json",
                "RESUME_MANIFEST_FINE.json", "RESUME_MANIFEST_SS.json")
V1_CHECKPOINT = "checkpoints/fractus_1b_gpu{i}.pt"
V1_SHARDS = ("data/shard_gpu{i}.pt", "data/shard_gpu{i}.npy")

# ---- the hub --------------------------------------------------------------------------
SYNC_STATE = "logs/sync_state.json"
HUB_LOG = "logs/hub.log"            # every retry of a hub call (launcher/cli/hub.py)
# The hub's rate limiting and the last hour's commits (launcher/hub/hub_rate.py).
HUB_RATE_STATE = "logs/hub_rate.json"
HUB_LEDGER = "logs/hub_ledger.json"  # retention's cache of the hub's revisions (rebuilt from it)
# Shards verified against `data:`'s revision, by path, size and mtime: a 4 GB shard is not
# hashed again at every launch.
DATA_VERIFIED_FILE = "logs/data_verified.json"
SNAPSHOT_DIR = ".fractus_sync"       # hard links of the files one sync sends; never pushed
MERGED_PATH = "checkpoints/FRACTUS_1B_8GPU_MERGED.pt"
HUB_SCRATCH_DIR = ".fractus_hub"     # the store's downloads in progress
HELD_FILE = "logs/hub_lease.json"    # the hub writer lease this pod took
NODE_LEASE_DIR = "logs/.node_lease"  # on a Ray node: the lease file of a push in flight
# On the hub: a Ray node's save pushed before its probe (launcher/supervise/ray/recovery.py)
RECOVERY_HUB_DIR = "recovery"      # recovery/<its path>
RECOVERY_STAGING_DIR = "checkpoints/recovery"   # on the node: links of saves waiting to go
# In RECOVERY_STAGING_DIR: each GPU's newest checked save waiting for the node's commit, each
# running pusher, the committing pusher's lock, the last commit, a commit's links in flight.
RECOVERY_POSTED_PREFIX = "posted-gpu"
RECOVERY_PUSHER_PREFIX = "pusher-gpu"
RECOVERY_COMMIT_LOCK = ".commit.lock"
RECOVERY_COMMIT_STATE = ".committed.json"
RECOVERY_SENDING_PREFIX = ".sending-"
# On a Ray pod's head: each GPU's last worker start (launcher/supervise/ray/starts.py)
RAY_LINEAGE_FILE = "logs/ray_lineage.json"
