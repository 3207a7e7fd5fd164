"""What patchkit says, as data: one enumeration of codes, and a reason is a code plus facts.

Below the command line nothing makes a sentence. A state's reason, a warning, a
notice, a refusal is a :class:`Reason`: a :class:`Code` from the one enumeration
here and the facts the words are made from (a path, a patch, a version, the
command to run). The words are made where output is made
(:mod:`patchkit.cli.words`), so rewording one sentence never changes another
command's output, and ``--json`` carries each message's code beside its words
(docs/json.md). A code is a stable kebab-case word: adding one is additive, renaming
or removing one bumps the JSON ``format``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Code(str, Enum):
    """Every message's code (Python 3.10 has no StrEnum): compares and prints as its value."""

    def __str__(self) -> str:
        return self.value

    # ----- a patch's state, why (status, apply, revert) -----
    DECIDED = "decided"  # the catalogue's decision for this release, its own text
    PREDATES_CATALOGUE = "predates-catalogue"
    APPLIED_FROM_OLDER_CATALOGUE = "applied-from-older-catalogue"
    APPLIED_WITHOUT_ENTRY = "applied-without-entry"
    APPLIED_IN_COMMIT = "applied-in-commit"  # fork mode: the commit that applied it
    REPLACED = "replaced"  # apply --only ID put the current version in place of an older
    OPT_IN = "opt-in"
    UNDER_LATER_PATCH = "under-later-patch"
    FOREIGN_BACKUP = "foreign-backup"
    UNKNOWN_PATCH_ON_TOP = "unknown-patch-on-top"
    EDITED = "edited"
    OTHER_RELEASE_INSTALLED = "other-release-installed"
    PARTLY_REINSTALLED = "partly-reinstalled"
    DIFFERS_FROM_RECORD = "differs-from-record"
    CHANGED_UPSTREAM = "changed-upstream"
    VARIANT_NOT_MADE = "variant-not-made"
    FILE_MISSING = "file-missing"
    HUNK_MISMATCH = "hunk-mismatch"
    NO_VARIANT_MATCHES = "no-variant-matches"
    # why --force may not restore an edited file
    BACKUP_NOT_THIS_RELEASE = "backup-not-this-release"
    APPLIED_TO_OTHER_VERSION = "applied-to-other-version"
    BACKUP_NOT_THIS_COMMIT = "backup-not-this-commit"  # a checkout's HEAD changed the file

    # ----- warnings and notes of a run -----
    UNTESTED_RELEASE = "untested-release"
    NEWER_THAN_CATALOGUE = "newer-than-catalogue"
    OUTDATED = "outdated"  # the warning that an applied patch is from an older catalogue
    OTHER_VARIANT = "other-variant"
    DECISION_EVIDENCE_MISSING = "decision-evidence-missing"
    ONLY_NOT_APPLIED = "only-not-applied"
    NOT_APPLIED = "not-applied"
    UNKNOWN_ENTRY = "unknown-entry"
    INTERRUPTED_RUN = "interrupted-run"
    INTERRUPTED_RUN_DRY = "interrupted-run-dry"
    CATALOGUE_INTERRUPTED = "catalogue-interrupted"
    CACHES_LEFT_ALONE = "caches-left-alone"
    AFTER_COMMIT = "after-commit"
    BYTECODE_LEFT = "bytecode-left"
    STALE_ENTRY = "stale-entry"
    DROPPED_STALE_ENTRY = "dropped-stale-entry"
    ROLLED_BACK = "rolled-back"  # a file an interrupted run had changed, restored
    ROLLED_BACK_NOTHING = "rolled-back-nothing"
    ROLLED_BACK_COMMITTED = "rolled-back-committed"  # the interrupted run had committed
    NOT_WRITABLE = "not-writable"
    COMMITTED = "committed"
    COMMITTED_REVERT = "committed-revert"

    # ----- known issues (notices) and what to do about them -----
    KNOWN_ISSUE = "known-issue"
    KNOWN_ISSUE_UNDECIDED = "known-issue-undecided"
    FIXED_BY_OTHER_PATCH = "fixed-by-other-patch"
    APPLY_FIXES = "apply-fixes"
    STILL_FITS = "still-fits"
    NO_FIX_HERE = "no-fix-here"
    CONFLICT_STAYS = "conflict-stays"

    # ----- refusals: nothing was changed -----
    REFUSED_CONFLICT = "refused-conflict"
    REFUSED_CHANGED_UPSTREAM = "refused-changed-upstream"
    REFUSED_REPLACE_UNDER_LATER = "refused-replace-under-later"
    REFUSED_REPLACE_DOES_NOT_APPLY = "refused-replace-does-not-apply"
    REFUSED_UNDER_LATER = "refused-under-later"
    REFUSED_UNKNOWN_ENTRY = "refused-unknown-entry"
    REFUSED_REVERT_UNDER = "refused-revert-under"
    REFUSED_REVERT_CONFLICT = "refused-revert-conflict"
    REFUSED_EDITED = "refused-edited"
    REFUSED_FORCE = "refused-force"
    REFUSED_BACKUP_DAMAGED = "refused-backup-damaged"
    REFUSED_STRICT = "refused-strict"
    REFUSED_HALF_WRITTEN_CATALOGUE = "refused-half-written-catalogue"
    REFUSED_READ_ONLY = "refused-read-only"  # cause: the lock-unavailable error
    REFUSED_AFTER_RECOVERY = "refused-after-recovery"
    CHANGED_WHILE_RUNNING = "changed-while-running"
    LOCK_NOT_CREATED = "lock-not-created"  # cause: the os-error
    LOCK_BUSY = "lock-busy"  # another run holds the tree's lock: path, waited (seconds)
    CATALOGUE_BUSY = "catalogue-busy"  # another refresh holds the catalogue's: path, waited
    LOCK_TIMEOUT_INVALID = "lock-timeout-invalid"  # PATCHKIT_LOCK_TIMEOUT: value, default
    REFRESH_NOT_WRITTEN = "refresh-not-written"  # cause: the os-error
    WRITE_UNDONE = "write-undone"  # cause: the os-error; written (files put back)
    RESTORE_FAILED = "restore-failed"  # cause: the error the roll-back met
    INVALID_JOURNAL = "invalid-journal"
    INVALID_STATE = "invalid-state"
    CHANGED_SINCE_INTERRUPTED = "changed-since-interrupted"
    JOURNAL_COPY_DAMAGED = "journal-copy-damaged"
    # the catalogue's journal (refresh; words: cli/lock_words.py)
    JOURNAL_TREE_NOT_REAL = "journal-tree-not-real"  # --target not the tree's real path
    CATALOGUE_FILE_TOO_LARGE = "catalogue-file-too-large"  # path, most (bytes)
    CATALOGUE_UNDO_FAILED = "catalogue-undo-failed"  # putting it back failed: error, journal
    CATALOGUE_RECOVERY_FAILED = "catalogue-recovery-failed"  # an OSError: error, journal
    JOURNAL_NOT_ACTED_ON = "journal-not-acted-on"  # problem (a reason), what to do by hand
    JOURNAL_TREE_UNREADABLE = "journal-tree-unreadable"  # tree, error
    JOURNAL_UNSAFE = "journal-unsafe"  # a path of it refused: error
    JOURNAL_FILE_CHANGED = "journal-file-changed"  # path, changed since
    JOURNAL_COPY_MISSING = "journal-copy-missing"  # path: its staged copy missing or damaged
    JOURNAL_INVALID = "journal-invalid"  # why
    # what recovering an interrupted refresh did
    CATALOGUE_STAGING_REMOVED = "catalogue-staging-removed"  # died before its journal
    CATALOGUE_RECOVERED = "catalogue-recovered"  # finished (or rolled back): paths
    # refresh
    REFRESH_INSTALLED_CATALOGUE = "refresh-installed-catalogue"
    REFRESH_CATALOGUE_RECOVERED = "refresh-catalogue-recovered"
    REFRESH_NOT_APPLIED = "refresh-not-applied"
    REFRESH_NO_VARIANT = "refresh-no-variant"
    REFRESH_UNDER_LATER = "refresh-under-later"
    REFRESH_NOTHING_LEFT = "refresh-nothing-left"
    REFRESH_BACKUP_DAMAGED = "refresh-backup-damaged"
    REFRESH_SHARED_FILE = "refresh-shared-file"
    REFRESH_ENTRY_CHANGED = "refresh-entry-changed"
    REFRESH_NOT_PRISTINE = "refresh-not-pristine"
    REFRESH_CREATED_GONE = "refresh-created-gone"
    REFRESH_NEW_FILE = "refresh-new-file"
    REFRESH_CREATED_NOWHERE = "refresh-created-nowhere"
    REFRESH_INEXACT = "refresh-inexact"
    REFRESH_OUTSIDE_CATALOGUE = "refresh-outside-catalogue"
    # fork mode
    CHECKOUT_DIRTY = "checkout-dirty"
    NO_GIT_IDENTITY = "no-git-identity"
    BRANCH_ELSEWHERE = "branch-elsewhere"
    GIT_FAILED = "git-failed"

    # ----- doctor: the GPUs it sees, a tuned config's problem -----
    NO_NVIDIA_SMI = "no-nvidia-smi"
    NVIDIA_SMI_FAILED = "nvidia-smi-failed"
    NO_GPU_LISTED = "no-gpu-listed"
    TUNED_UNREADABLE = "tuned-unreadable"
    TUNED_NOT_NESTED = "tuned-not-nested"
    TUNED_NO_SINGLE_SLICE = "tuned-no-single-slice"
    TUNED_REPLACES_BLOCK_N = "tuned-replaces-block-n"
    # doctor: why a .pyc does not match its source (path: the .pyc; source: its .py)
    PYC_UNREADABLE = "pyc-unreadable"  # error
    PYC_TRUNCATED = "pyc-truncated"  # shorter than the 16 bytes of its header
    PYC_UNCHECKED_HASH = "pyc-unchecked-hash"  # hash-based, never re-validated
    PYC_HASH_DIFFERS = "pyc-hash-differs"  # hash-based, of another source
    PYC_OTHER_SOURCE = "pyc-other-source"  # timestamp-based: another mtime or size
    # doctor: why a bug is exposed, protected, not affected or unknown here
    VERDICT_NO_TREE = "verdict-no-tree"
    VERDICT_NO_VERSION = "verdict-no-version"
    VERDICT_OUT_OF_RANGE = "verdict-out-of-range"
    VERDICT_NO_GPU = "verdict-no-gpu"  # no GPU of the compute capability the bug needs
    VERDICT_PTXAS_FIXED = "verdict-ptxas-fixed"
    VERDICT_UNDECIDED = "verdict-undecided"
    VERDICT_UPSTREAM = "verdict-upstream"
    VERDICT_PROTECTED = "verdict-protected"  # the applied patches' own lines
    VERDICT_OVERRIDDEN = "verdict-overridden"
    VERDICT_IN_CONFLICT = "verdict-in-conflict"
    VERDICT_NOT_APPLIED = "verdict-not-applied"
    VERDICT_STALE = "verdict-stale"
    VERDICT_FRESH = "verdict-fresh"
    SCAN_HAZARD = "scan-hazard"
    SCAN_NONE_RUN = "scan-none-run"
    SCAN_CLEAN = "scan-clean"
    # what a verdict adds after its reason
    PATCH_MOVED = "patch-moved"  # a patch of the bug no longer fits its code
    PATCH_FITS = "patch-fits"
    PATCH_SWITCHED_OFF = "patch-switched-off"
    SCAN_OTHER_TRITON = "scan-other-triton"
    SCAN_IDLE_HAZARD = "scan-idle-hazard"
    SCAN_ERRORS = "scan-errors"
    # doctor: a verdict's fix
    FIX_COMMAND = "fix-command"
    FIX_AFTER_CONFLICT = "fix-after-conflict"
    FIX_OVERRIDE_FILES = "fix-override-files"
    FIX_RETUNE = "fix-retune"
    FIX_SWITCHES = "fix-switches"
    FIX_STALE = "fix-stale"

    # ----- errors: the kind of failure a command ended with (patchkit.errors; the words
    # are the line made where it was raised, the facts beside each code) -----
    # (a lower error an error quotes is its fact ``cause``; usage errors are USAGE, an
    # interrupted refresh INTERRUPTED, a hunk that does not fit HUNK_MISMATCH, a refresh
    # interrupted while writing the catalogue CATALOGUE_INTERRUPTED, no vLLM for this
    # Python VLLM_NOT_FOUND, a model shard changed under verify CHANGED_WHILE_RUNNING)
    OS_ERROR = "os-error"  # path, errno (its name: "ENOSPC"), error (the system's words)
    UNSAFE_PATH = "unsafe-path"  # path, origin, kind (a link's target): out of the tree, a link
    FILE_TOO_LARGE = "file-too-large"  # path, limit (bytes)
    FILE_UNUSABLE = "file-unusable"  # a file of an adapter's or a model's directory: path, detail
    LOCK_UNAVAILABLE = "lock-unavailable"  # the tree's lock cannot be made: path, error
    # the catalogue, and the patch ids asked for
    CATALOGUE_INVALID = "catalogue-invalid"  # path (a catalogue file or diff), detail
    UNKNOWN_PATCH = "unknown-patch"  # patch, known (the catalogue's ids)
    # the vLLM tree
    VLLM_INSTALL_INVALID = "vllm-install-invalid"  # its dist-info: path, detail
    VLLM_CODE_NOT_UNDERSTOOD = "vllm-code-not-understood"  # a vLLM file patchkit cannot read: path
    VLLM_IMPORT_FAILED = "vllm-import-failed"  # verify: path (the tree), error
    # fetch
    FETCH_FAILED = "fetch-failed"  # the index or the server: host, status, path
    WHEEL_NOT_FOUND = "wheel-not-found"  # version
    WHEEL_MISMATCH = "wheel-mismatch"  # not the size or sha256 its index gives: wheel
    WHEEL_INVALID = "wheel-invalid"  # its zip broken or hostile: wheel, cause
    RECORD_MISMATCH = "record-mismatch"  # a member and the wheel's RECORD disagree: wheel
    PIP_CONFIG_INVALID = "pip-config-invalid"  # path and error, or key and value
    FETCH_DEADLINE_INVALID = "fetch-deadline-invalid"  # PATCHKIT_FETCH_DEADLINE: value
    VERSION_INVALID = "version-invalid"  # version
    DEST_UNUSABLE = "dest-unusable"  # --dest: path
    # probe report
    PROBE_LOG_INVALID = "probe-log-invalid"  # path, line (its number), detail
    PROBE_LOG_UNREADABLE = "probe-log-unreadable"  # path, error
    # adapters, models and their files (adapter check, verify, doctor --kernels)
    SAFETENSORS_INVALID = "safetensors-invalid"  # path, detail
    DTYPE_UNSUPPORTED = "dtype-unsupported"  # dtype
    MODEL_CONFIG_INVALID = "model-config-invalid"  # config.json: path, detail, key
    CHECKPOINT_INVALID = "checkpoint-invalid"  # the base model's directory or a file: path
    ADAPTER_REFUSED = "adapter-refused"  # verify: path, module or tensor
    MERGE_REFUSED = "merge-refused"  # path (the adapter's weights), module, detail
    # verify's run
    GPU_UNAVAILABLE = "gpu-unavailable"  # torch (whether it is there)
    WORKDIR_UNUSABLE = "workdir-unusable"  # path
    NOT_ENOUGH_SPACE = "not-enough-space"  # path, needed, free (bytes)
    REFERENCE_DOES_NOT_FIT = "reference-does-not-fit"  # needed, working, free, gpus; spilled
    REFERENCE_FAILED = "reference-failed"  # refused ("label: error")
    # canary
    DEPENDENCY_MISSING = "dependency-missing"  # packages
    SERVER_UNREACHABLE = "server-unreachable"  # url
    SERVER_UNAUTHORIZED = "server-unauthorized"  # url, http_status
    NOT_A_VLLM_SERVER = "not-a-vllm-server"  # url, http_status

    # ----- an error the command line makes itself, by how it ends -----
    ERROR = "error"  # exit 1: the user's to act on
    USAGE = "usage"  # exit 2
    INTERNAL_ERROR = "internal-error"  # exit 3: a bug in patchkit
    INTERRUPTED = "interrupted"  # exit 130, 143, 129

    # ----- messages of the other commands, by kind -----
    # why a cache was left alone, or had nothing to clear (words: cli/cache_words.py)
    CACHE_NOT_ABSOLUTE = "cache-not-absolute"  # the environment's path: source
    CACHE_ABSENT = "cache-absent"  # nothing to clear
    CACHE_UNSAFE = "cache-unsafe"  # a link or a non-directory on its way: error
    CACHE_HOLDS_KEPT = "cache-holds-kept"  # /, the home, the working directory, the tree
    CACHE_IN_TREE = "cache-in-tree"  # inside the vLLM tree
    CACHE_FOREIGN_ENTRY = "cache-foreign-entry"  # an entry not of the cache's layout
    CACHE_MOUNT_INSIDE = "cache-mount-inside"  # a mount point below it
    CACHE_PARTLY_CLEARED = "cache-partly-cleared"  # stopped midway: error
    CACHE_OS_ERROR = "cache-os-error"  # opening or clearing it failed: error
    VLLM_NOT_FOUND = "vllm-not-found"  # doctor without a tree
    RUNNER_NOT_HOOKED = "runner-not-hooked"
    # the model runner: why it is the one, or why it is unknown (patchkit.cli.runner_words)
    RUNNER_BY_CONFIG = "runner-by-config"  # use_v2_model_runner decides, at file:line
    RUNNER_NO_CONFIG_SWITCH = "runner-no-config-switch"  # the variable alone (0.17-0.21)
    RUNNER_ONLY_ONE = "runner-only-one"  # the other runner's file is gone
    RUNNER_REFUSED = "runner-refused"  # vLLM raises: its message, or where
    RUNNER_V2_NO_HYBRID = "runner-v2-no-hybrid"  # V2 has no hybrid state: the assert's file:line
    RUNNER_BAD_VALUE = "runner-bad-value"  # the variable's value fails vLLM's int()
    RUNNER_ENV_REFUSED = "runner-env-refused"  # vLLM's start refuses the value: file:line
    RUNNER_ENV_REDUNDANT = "runner-env-redundant"  # the value it lets through, and warns of
    RUNNER_UNKNOWN = "runner-unknown"  # code of a shape the check does not know: kind
    # adapter check: one code per kind of finding
    ADAPTER_FILE = "adapter-file"
    ADAPTER_CONFIG = "adapter-config"
    ADAPTER_SCALING = "adapter-scaling"
    ADAPTER_NONFINITE = "adapter-nonfinite"
    ADAPTER_NAME = "adapter-name"
    ADAPTER_RANK = "adapter-rank"
    ADAPTER_RANK_LIMIT = "adapter-rank-limit"
    ADAPTER_SHAPE = "adapter-shape"
    ADAPTER_LAYOUT = "adapter-layout"
    ADAPTER_TARGET = "adapter-target"
    ADAPTER_RELEASE = "adapter-release"
    ADAPTER_EFFECT = "adapter-effect"

    # ----- canary: what one model's answer showed (words: cli/canary_words.py) -----
    CANARY_NAN_ERROR = "canary-nan-error"  # an HTTP error whose message reports NaN
    CANARY_HTTP_ERROR = "canary-http-error"  # an HTTP error without NaN
    CANARY_RETRY_FAILED = "canary-retry-failed"  # the request without logprobs failed too
    CANARY_UNANSWERED = "canary-unanswered"  # no answer: refused, timed out, budget spent
    CANARY_ANSWER_SHAPE = "canary-answer-shape"  # a field of the wrong type
    CANARY_ZERO_RUN = "canary-zero-run"  # token id 0 again and again ('!!!!')
    CANARY_BANG_TEXT = "canary-bang-text"  # a run of '!' in a text without token ids
    CANARY_LOGPROBS_ABSENT = "canary-logprobs-absent"
    CANARY_LOGPROBS_NAN = "canary-logprobs-nan"
    CANARY_LOGPROBS_INFINITE = "canary-logprobs-infinite"
    CANARY_LOGPROBS_POSITIVE = "canary-logprobs-positive"
    CANARY_LOGPROBS_NULL = "canary-logprobs-null"
    CANARY_LOGPROB_IMPOSSIBLE = "canary-logprob-impossible"  # a greedy token far too unlikely
    CANARY_COUNTER_ROSE = "canary-counter-rose"
    CANARY_NO_EFFECT = "canary-no-effect"  # an adapter answering as its parent does
    CANARY_NOT_SERVED = "canary-not-served"
    CANARY_NOT_CHECKED = "canary-not-checked"
    CANARY_PROMPT_SHORTENED = "canary-prompt-shortened"
    # ----- canary: notes of a run -----
    CANARY_COUNTER_ABSENT = "canary-counter-absent"  # counter: its name
    CANARY_COUNTER_UNREADABLE = "canary-counter-unreadable"  # a value no count: value
    CANARY_COUNTER_TOO_LONG = "canary-counter-too-long"  # more than most lines
    CANARY_COUNTER_NOT_PROMETHEUS = "canary-counter-not-prometheus"  # the parser's error
    CANARY_METRICS_NOT_READ = "canary-metrics-not-read"  # no answer: error
    CANARY_METRICS_HTTP_STATUS = "canary-metrics-http-status"  # answered http_status
    CANARY_MODELS_SKIPPED = "canary-models-skipped"
    CANARY_NO_MODELS = "canary-no-models"
    # ----- canary: the verdict and what to do next -----
    CANARY_OK = "canary-ok"  # count models, skipped
    CANARY_FAILED = "canary-failed"  # bad, no_effect, polluted, others; models by verdict
    CANARY_STEP_DOCTOR = "canary-step-doctor"
    CANARY_STEP_APPLY = "canary-step-apply"
    CANARY_STEP_REPLACE_ADAPTER = "canary-step-replace-adapter"
    CANARY_STEP_BASE_NAN = "canary-step-base-nan"
    CANARY_STEP_POLLUTED = "canary-step-polluted"
    CANARY_STEP_RESTART = "canary-step-restart"
    CANARY_STEP_SERVER_LOG = "canary-step-server-log"
    CANARY_STEP_MODEL_NAMES = "canary-step-model-names"
    CANARY_STEP_COUNTER = "canary-step-counter"
    CANARY_STEP_NO_EFFECT = "canary-step-no-effect"  # the likely causes of an inert adapter
    CANARY_STEP_ADAPTER_CHECK = "canary-step-adapter-check"  # the admission check to run

    # ----- adapter check: findings and notes added with the no-op adapter's checks -----
    ADAPTER_SERVED_AS_BASE = "adapter-served-as-base"  # no module reaches a wrapped one
    ADAPTER_MODULES_IGNORED = "adapter-modules-ignored"  # some modules never reach one
    ADAPTER_ZERO_FACTORS = "adapter-zero-factors"  # every lora_B (or lora_A) all zero
    ADAPTER_ZERO_MODULES = "adapter-zero-modules"  # some modules' factors all zero
    # ----- adapter check: what is wrong, finer than the kind (words: cli/adapter_words.py) -----
    ADAPTER_PICKLE = "adapter-pickle"  # a .bin/.pt weights file, refused unread
    ADAPTER_NO_WEIGHTS = "adapter-no-weights"
    ADAPTER_NOT_FLOAT = "adapter-not-float"  # an integer or boolean tensor
    ADAPTER_NOT_SCANNED = "adapter-not-scanned"  # a float type patchkit does not scan
    ADAPTER_EMPTY = "adapter-empty"  # a tensor of no values
    ADAPTER_NONFINITE_VALUES = "adapter-nonfinite-values"  # NaN, Inf or past bf16's largest
    ADAPTER_NOT_FACTOR = "adapter-not-factor"  # a tensor vLLM reads as no LoRA factor
    ADAPTER_UNPAIRED = "adapter-unpaired"  # lora_A without lora_B or the other way round
    ADAPTER_NOT_MATRICES = "adapter-not-matrices"
    ADAPTER_TRANSPOSED = "adapter-transposed"  # lora_A and lora_B each other's shape
    ADAPTER_RANKS_DIFFER = "adapter-ranks-differ"  # lora_A's rank is not lora_B's
    ADAPTER_RANK_NOT_CONFIG = "adapter-rank-not-config"  # not r, nor rank_pattern's
    ADAPTER_CONFIG_ABOVE_MAX_RANK = "adapter-config-above-max-rank"  # r or rank_pattern's
    ADAPTER_ABOVE_MAX_RANK = "adapter-above-max-rank"  # a tensor's rank
    ADAPTER_SCALE_OUT_OF_RANGE = "adapter-scale-out-of-range"
    ADAPTER_UNREADABLE = "adapter-unreadable"  # the weights file: the reader's error
    # against the model's config.json
    ADAPTER_NO_SUCH_LAYER = "adapter-no-such-layer"  # layer (None: no index), layers
    ADAPTER_NO_SUCH_EXPERT = "adapter-no-such-expert"  # expert (None: no index), experts
    ADAPTER_NO_SUCH_MODULE = "adapter-no-such-module"  # in that layer of the model
    ADAPTER_EMBEDDING_MISFIT = "adapter-embedding-misfit"  # embed_tokens or lm_head
    ADAPTER_SWAPPED_IN_OUT = "adapter-swapped-in-out"  # a linear module's in and out swapped
    ADAPTER_MISFIT = "adapter-misfit"  # a linear module's factors fit no way round
    ADAPTER_NO_EXPERTS = "adapter-no-experts"  # expert factors on a dense model
    ADAPTER_NESTED_TOO_DEEP = "adapter-nested-too-deep"  # experts under more than 2 params
    ADAPTER_EXPERT_ROWS = "adapter-expert-rows"  # lora_A's rows not a multiple of E
    ADAPTER_EXPERTS_LEGACY = "adapter-experts-legacy"  # PEFT <= 0.19's expert layout
    ADAPTER_EXPERTS_MISFIT = "adapter-experts-misfit"  # fit no expert parameter
    ADAPTER_NO_TARGET_MODULE = "adapter-no-target-module"  # target_modules names none
    ADAPTER_NO_TARGET_PARAMETER = "adapter-no-target-parameter"  # target_parameters likewise
    # against the --target release (adapters.targetcheck)
    ADAPTER_ONE_EXPERT_PARAMETER = "adapter-one-expert-parameter"  # partial-moe-adapter's bug
    ADAPTER_PARTIAL_GDN = "adapter-partial-gdn"  # partial-gdn-adapter's bug
    ADAPTER_NOT_WRAPPED = "adapter-not-wrapped"  # no module of the release named like it
    ADAPTER_REACH_REFUSED = "adapter-reach-refused"  # the loader refuses it: why
    ADAPTER_PATTERNS_UNREAD = "adapter-patterns-unread"  # rank/alpha_pattern before 0.32.0
    # adapter check's notes
    ADAPTER_EMBEDDING_COPY = "adapter-embedding-copy"  # a full embedding, skipped
    ADAPTER_OUTSIDE_LAYERS = "adapter-outside-layers"  # shapes not checked
    ADAPTER_OTHER_LAYOUT = "adapter-other-layout"  # layers under another prefix (no --target)
    ADAPTER_EXPERT_BY_SHAPE = "adapter-expert-by-shape"  # one expert parameter, by its shapes
    ADAPTER_VISION_TOWER = "adapter-vision-tower"  # modules text prompts never reach
    ADAPTER_RELEASE_UNDECIDED = "adapter-release-undecided"  # a release finding, not decided
    # adapter check's checks skipped, and why
    ADAPTER_SKIPPED_NO_MODEL = "adapter-skipped-no-model"
    ADAPTER_SKIPPED_NO_TARGET = "adapter-skipped-no-target"
    ADAPTER_SKIPPED_UNKNOWN_MODEL = "adapter-skipped-unknown-model"  # no widths: architecture
    ADAPTER_SKIPPED_LORA_MODULES = "adapter-skipped-lora-modules"  # release's names unread
    ADAPTER_SKIPPED_REACH = "adapter-skipped-reach"  # which modules it reaches: error
    # ----- where one adapter module ends on a release (adapter check --target's targets) -----
    REACH_SKIP_PREFIX = "reach-skip-prefix"  # the model's lora_skip_prefixes skip it
    REACH_MAPS_TO_NOTHING = "reach-maps-to-nothing"  # its name maps to nothing (vLLM raises)
    REACH_NO_WRAPPED_NAME = "reach-no-wrapped-name"  # no wrapped module has its last name
    REACH_NOT_LORA_LAYER = "reach-not-lora-layer"  # layer: a module that is no LoRA layer
    REACH_WRAPPED = "reach-wrapped"  # packed: the packed module it is part of, or None
    REACH_VISION_TOWER = "reach-vision-tower"  # option: the flag that wraps it; refused_layer
    REACH_NOT_IN_MODEL = "reach-not-in-model"  # served: the class; layers: its layers' prefix
    ADAPTER_SKIPPED_PATTERNS = "adapter-skipped-patterns"  # whether it reads the patterns
    # ----- adapter_config.json: what the rule refuses (words: cli/adapter_config_words.py) -----
    ADAPTER_CONFIG_MISSING = "adapter-config-missing"  # no adapter_config.json
    ADAPTER_CONFIG_UNREADABLE = "adapter-config-unreadable"  # not a JSON object, a FIFO: error
    ADAPTER_CONFIG_KEY_MISSING = "adapter-config-key-missing"  # r, lora_alpha, target_modules
    ADAPTER_CONFIG_NOT_LORA = "adapter-config-not-lora"  # peft_type: value
    ADAPTER_CONFIG_BAD_R = "adapter-config-bad-r"
    ADAPTER_CONFIG_BAD_ALPHA = "adapter-config-bad-alpha"
    ADAPTER_CONFIG_BAD_RSLORA = "adapter-config-bad-rslora"
    ADAPTER_CONFIG_BAD_TARGET_MODULES = "adapter-config-bad-target-modules"
    ADAPTER_CONFIG_BAD_TARGET_PARAMETERS = "adapter-config-bad-target-parameters"
    ADAPTER_CONFIG_PATTERN_NOT_OBJECT = "adapter-config-pattern-not-object"
    ADAPTER_CONFIG_BAD_PATTERN_RANK = "adapter-config-bad-pattern-rank"
    ADAPTER_CONFIG_BAD_PATTERN_ALPHA = "adapter-config-bad-pattern-alpha"
    ADAPTER_CONFIG_KEY_REFUSED = "adapter-config-key-refused"  # a pattern key: pattern, why
    ADAPTER_CONFIG_DORA = "adapter-config-dora"
    ADAPTER_CONFIG_BIAS = "adapter-config-bias"
    ADAPTER_CONFIG_MODULES_TO_SAVE = "adapter-config-modules-to-save"
    ADAPTER_CONFIG_TRAINABLE_TOKENS = "adapter-config-trainable-tokens"
    ADAPTER_CONFIG_FEATURE = "adapter-config-feature"  # lora_bias, aLoRA, ...: feature, value
    ADAPTER_CONFIG_INIT = "adapter-config-init"  # PiSSA-style init_lora_weights
    # verify's and doctor's one line: path, key, problem (a reason), more (problems after it)
    ADAPTER_CONFIG_REFUSED = "adapter-config-refused"

    # ----- probe report: a warning of its log (words: cli/probe_words.py) -----
    PROBE_LAST_LINE_CUT = "probe-last-line-cut"  # skipped; the lines before it reported
    # probe report: where a request went bad, and where to look
    PROBE_INPUT_BAD = "probe-input-bad"  # bad already at the layer's input: upstream
    PROBE_PROJECTION_BAD = "probe-projection-bad"  # a LoRA projection first: module, adapter
    PROBE_OUTPUT_BAD = "probe-output-bad"  # the layer's own compute, or LoRA it does not watch
    PROBE_QUARANTINED = "probe-quarantined"  # its adapter quarantined at load: the tensor
    PROBE_QUARANTINE = "probe-quarantine"  # one quarantine the log recorded, served or not

    # ----- verify: why an adapter's verdict, what decides instead, why its reference
    # (words: cli/verify_words.py) -----
    VERIFY_CHECK_FAILED = "verify-check-failed"  # check, detail: the first decided failure
    VERIFY_CHECK_OPEN = "verify-check-open"  # check, detail: the first the rule left open
    # reference (its kind), controls: "past-failure-line", "outside" or None (none served),
    # fail_excess (the failure line against PEFT)
    VERIFY_WITHIN = "verify-within"
    VERIFY_DECIDES_PEFT = "verify-decides-peft"  # the PEFT reference would decide
    VERIFY_DECIDES_OTHER_PROMPTS = "verify-decides-other-prompts"  # another seed, longer ones
    # open by tokens alone (its median and stretches inside): other prompts that pass it;
    # lone: tokens allowed past the max bound (a MoE), ceiling: how far they may go
    VERIFY_DECIDES_TOKENS = "verify-decides-tokens"
    VERIFY_DECIDES_MEASURED_STRETCHES = "verify-decides-measured-stretches"
    VERIFY_DECIDES_REFERENCE_RUN = "verify-decides-reference-run"  # missing: why it did not
    VERIFY_REFERENCE_ASKED = "verify-reference-asked"  # reference: what --reference named
    VERIFY_ROUNDING_SMALL = "verify-rounding-small"  # mean, max
    # coarse (mean, max; None: none finite), it decided all the same
    VERIFY_MERGED_DECIDED = "verify-merged-decided"
    VERIFY_MERGED_UNDECIDED = "verify-merged-undecided"  # verdict: the merged one's why
    VERIFY_MERGED_NOT_RUN = "verify-merged-not-run"  # missing: its engine's error
    VERIFY_PEFT_DECIDES = "verify-peft-decides"  # because: why the merged one was set aside
    VERIFY_PEFT_DID_NOT_RUN = "verify-peft-did-not-run"  # because, missing: its error
    VERIFY_PARTIAL_PEFT = "verify-partial-peft"  # one expert parameter: no merged reference
    VERIFY_MOE_REFERENCE = "verify-moe-reference"  # progress: adapter, reference, why


@dataclass(frozen=True)
class Reason:
    """A code and the facts its words are made from, immutable (a reason is a value).

    Facts are JSON's kinds of value (text, numbers, booleans, None, lists of text) or
    another Reason (a refusal carries the conflict it refuses).
    """

    code: Code
    facts: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, code: Code, **facts: Any) -> Reason:
        return cls(
            code, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in facts.items())
        )

    def __getitem__(self, key: str) -> Any:
        return dict(self.facts)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.facts).get(key, default)

    def __str__(self) -> str:
        """The code and its facts (a log or a debugger's view; people read the words)."""
        facts = ", ".join(f"{k}={v!r}" for k, v in self.facts)
        return f"{self.code}({facts})"


@dataclass(frozen=True)
class Line(Reason):
    """An error's reason (:class:`patchkit.errors.PatchkitError`): its code and facts, and
    the line the error was raised with (the fact ``text``), which are its words."""
