"""Which GPU model runner (V1 or Model Runner V2) vLLM picks for a Qwen3.5/3.6 hybrid with LoRA.

Read from the tree's own code, never imported: ``vllm/envs.py`` (the default
of ``VLLM_USE_V2_MODEL_RUNNER``), ``vllm/config/vllm.py`` (the
``use_v2_model_runner`` property and the methods it calls, evaluated here by a
small interpreter over their syntax tree), which runner files exist, and where the
variable is set, what vLLM's start-up check of its environment
(``Platform.validate_environ`` in ``vllm/platforms/interface.py``) does with its value. The
interpreter knows one configuration, vLLM's defaults plus ``--enable-lora``
for a Qwen3.5/3.6 hybrid (Gated DeltaNet + attention) on CUDA; a statement,
call or attribute it does not know makes the answer ``unknown`` with the line
it stopped at, never a guess.

Every why is a :class:`~patchkit.codes.Reason` (``runner-*`` codes and their facts:
the file, the line, what was met there); the words are made in
:mod:`patchkit.cli.runner_words`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from patchkit.codes import Code, Reason
from patchkit.fs.safepath import Root

ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1, V2 = "v1", "v2"
NAMES = {V1: "V1", V2: "Model Runner V2"}
CONFIG = "vllm/config/vllm.py"
ENVS = "vllm/envs.py"
V1_FILE = "vllm/v1/worker/gpu_model_runner.py"
V2_FILE = "vllm/v1/worker/gpu/model_runner.py"
V2_KV_CACHE = "vllm/v1/worker/gpu/attn_utils.py"  # V2's KV caches, a hybrid's state among them
PLATFORM = "vllm/platforms/interface.py"  # Platform.validate_environ: the environment's check
CUDA_PLATFORM = "vllm/platforms/cuda.py"  # CUDA's platform, which could override it
ENGINE_ARGS = "vllm/engine/arg_utils.py"  # the engine's start, which calls it
MAX_SOURCE_BYTES = 4 << 20
MAX_STEPS = 20_000
ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


class Unknown(Exception):
    """The code is not a shape this module understands; ``reason`` says where and what."""

    def __init__(self, reason: Reason):
        super().__init__(str(reason))
        self.reason = reason


def _unknown(kind: str, line: int | None = None, file: str | None = CONFIG, **facts) -> Unknown:
    """``runner-unknown``: what the check met (``kind``) at ``file``:``line``, and its facts."""
    return Unknown(Reason.of(Code.RUNNER_UNKNOWN, kind=kind, file=file, line=line, **facts))


class _Refused(Exception):
    """vLLM raises here: it refuses the configuration; ``reason`` is its message."""

    def __init__(self, reason: Reason):
        super().__init__(str(reason))
        self.reason = reason


@dataclass(frozen=True)
class RunnerChoice:
    """What the tree's code decides; ``runner`` is ``v1``, ``v2`` or ``unknown``."""

    runner: str
    reason: Reason  # why (or why unknown)
    only: bool = False  # the other runner is gone from the tree
    flip_value: int | None = None  # the ENV value that flips it (0 or 1); None: nothing does
    flip_to: str | None = None  # the runner the flip gives
    flip_refused: Reason | None = None  # the flip makes vLLM refuse to start: its message
    env_value: str | None = None  # the environment's value, as given
    effective: str | None = None  # the runner with that value (v1, v2, refused, unknown)
    effective_reason: Reason | None = None

    @property
    def known(self) -> bool:
        return self.runner in (V1, V2)

    @property
    def flip(self) -> str | None:
        """The assignment that flips the runner ("VLLM_USE_V2_MODEL_RUNNER=0"), or None."""
        return None if self.flip_value is None else f"{ENV}={self.flip_value}"


def hooked(files) -> frozenset[str]:
    """The runners whose files a patch's variant changes (``v1``, ``v2``)."""
    return frozenset(
        runner for runner, relpath in ((V1, V1_FILE), (V2, V2_FILE)) if relpath in files
    )


def decide(fs: Root, env_value: str | None) -> RunnerChoice:
    """The runner for the tree behind ``fs``; ``env_value`` is ``VLLM_USE_V2_MODEL_RUNNER``."""
    try:
        return _checked_at_start(fs, _decide(fs, env_value))
    except Unknown as exc:
        return RunnerChoice("unknown", exc.reason, env_value=env_value)


def _decide(fs: Root, env_value: str | None) -> RunnerChoice:
    has_v1 = fs.lstat(V1_FILE, "runner") is not None
    has_v2 = fs.lstat(V2_FILE, "runner") is not None
    if not has_v1 and not has_v2:
        raise _unknown("no-runner-files", file=None, v1=V1_FILE, v2=V2_FILE)
    envs_tree = _parse(fs, ENVS)
    default = _env_default(envs_tree)  # None: unset means "let the config decide"
    if not has_v1 or not has_v2:
        if default is not _ABSENT:
            raise _unknown("one-runner-env-read", file=ENVS, env=ENV)
        runner = V2 if has_v2 else V1
        missing = V1_FILE if has_v2 else V2_FILE
        return RunnerChoice(
            runner,
            Reason.of(Code.RUNNER_ONLY_ONE, missing=missing, file=ENVS, env=ENV),
            only=True,
            env_value=env_value,
            effective=runner,
        )
    if default is _ABSENT:
        raise _unknown("env-not-read", file=ENVS, env=ENV)
    config = _Config(_parse(fs, CONFIG))
    outcomes = {value: config.runner(value) for value in (None, False, True)}
    if any(runner == V2 for runner, _ in outcomes.values()):
        no_state = _v2_without_hybrid_state(fs)
        if no_state is not None:
            outcomes = {
                value: ("refused", no_state) if runner == V2 else (runner, why)
                for value, (runner, why) in outcomes.items()
            }
    runner, why = outcomes[None] if default is None else outcomes[default]
    if runner not in (V1, V2):
        raise _unknown("refused-unset", env=ENV, refusal=why)
    flip_value = runner == V1  # V1 by default: =1 asks for V2, and the other way round
    flip_runner, flip_why = outcomes[flip_value]
    choice = RunnerChoice(
        runner,
        why,
        flip_value=int(flip_value),
        flip_to=flip_runner if flip_runner in (V1, V2) else None,
        flip_refused=flip_why if flip_runner == "refused" else None,
        env_value=env_value,
    )
    if flip_runner == runner:
        choice = RunnerChoice(runner, why, env_value=env_value)
    return _with_env(choice, outcomes, default, env_value)


def _v2_without_hybrid_state(fs: Root) -> Reason | None:
    """Where Model Runner V2 cannot hold a hybrid's Gated DeltaNet (Mamba) state, why:
    ``runner-v2-no-hybrid`` with the assert vLLM stops at; None where nothing says so.

    Up to 0.19.1 nothing in vLLM's config refuses V2 for a hybrid (0.20.0 added the
    check), yet V2's KV cache code knows no MambaSpec: ``_reshape_kv_cache`` asserts that
    every layer's spec is an AttentionSpec, and a GDN layer's is a MambaSpec, so with
    ``VLLM_USE_V2_MODEL_RUNNER=1`` vLLM stops at start. From 0.21.0 that file imports
    MambaSpec and allocates the state (later releases keep it in other files of V2, and
    the assert is gone).
    """
    tree = _parse_present(fs, V2_KV_CACHE)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "MambaSpec" for a in node.names):
            return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and _isinstance_of(node.test, "AttentionSpec"):
            return Reason.of(Code.RUNNER_V2_NO_HYBRID, file=V2_KV_CACHE, line=node.lineno)
    return None


def _isinstance_of(test: ast.expr, name: str) -> bool:
    """``isinstance(x, name)``."""
    return (
        isinstance(test, ast.Call)
        and _dotted(test.func) == "isinstance"
        and len(test.args) == 2
        and isinstance(test.args[1], ast.Name)
        and test.args[1].id == name
    )


def _with_env(choice, outcomes, default, env_value) -> RunnerChoice:
    if env_value is None:
        return _replace(choice, effective=choice.runner)
    try:
        value = bool(int(env_value))  # what vLLM's envs.py does with it
    except ValueError:
        return _replace(
            choice,
            effective="refused",
            effective_reason=Reason.of(Code.RUNNER_BAD_VALUE, env=ENV, value=env_value[:40]),
        )
    runner, why = outcomes[value]
    return _replace(choice, effective=runner, effective_reason=why)


def _checked_at_start(fs: Root, choice: RunnerChoice) -> RunnerChoice:
    """The choice as vLLM's start-up check of its environment leaves it: where that check
    refuses the variable's value, vLLM never reaches its config (``effective`` refused);
    where it only warns, the runner stays. Unknown where the check names the variable in a
    shape this module does not read; the choice as it was where the variable is unset or
    the check does not name it."""
    if choice.env_value is None:
        return choice
    try:
        check = _environ_check(fs)
    except Unknown as exc:
        return _replace(choice, effective="unknown", effective_reason=exc.reason)
    if check is None:
        return choice
    accepted, raise_line, template, warn_line = check
    value = choice.env_value[:40]
    if choice.env_value == accepted:
        why = Reason.of(
            Code.RUNNER_ENV_REDUNDANT, env=ENV, value=value, file=PLATFORM, line=warn_line
        )
        return _replace(choice, effective_reason=why)
    raised = "".join(value if part is None else part for part in template)
    why = Reason.of(
        Code.RUNNER_ENV_REFUSED, env=ENV, value=value, raised=raised, file=PLATFORM, line=raise_line
    )
    return _replace(choice, effective="refused", effective_reason=why)


def _environ_check(fs: Root) -> tuple[str, int, tuple[str | None, ...], int | None] | None:
    """What ``Platform.validate_environ`` does with the variable: the one value it lets
    through, the line that raises for any other, vLLM's message there (text, None where the
    value goes) and the line that warns of the value let through; None where it does not
    name the variable.

    The engine calls it before it makes any config (``create_engine_config``). Up to
    0.33.0 it only warns of ``VLLM_*`` names vLLM does not know, and the variable was one it
    knew; from 0.34.0, which removed V1, any value but "1" raises ("Model Runner V1 has been
    removed. Unset this variable.") and "1" logs that it is redundant.
    """
    platform = _parse_present(fs, PLATFORM)
    method = _validate_environ(platform) if platform is not None else None
    if method is None or not any(
        isinstance(n, ast.Constant) and n.value == ENV for n in ast.walk(method)
    ):
        return None
    found = _refusing_branch(method)
    if found is None:
        raise _unknown("environ-not-understood", method.lineno, file=PLATFORM, env=ENV)
    cuda = _parse_present(fs, CUDA_PLATFORM)
    if cuda is not None and _validate_environ(cuda):
        raise _unknown("environ-overridden", file=CUDA_PLATFORM)
    engine = _parse_present(fs, ENGINE_ARGS)
    if engine is None or not any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "validate_environ"
        for n in ast.walk(engine)
    ):
        raise _unknown("environ-not-called", file=ENGINE_ARGS)
    return found


def _validate_environ(tree: ast.Module) -> ast.FunctionDef | None:
    """A class's ``validate_environ`` in the module, or None."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "validate_environ":
                    return item
    return None


def _refusing_branch(method: ast.FunctionDef):
    """``for NAME, VALUE in os.environ.items(): if NAME == ENV: if VALUE != "X": raise
    E(message)`` and, after it, the warning: (X, the raise's line, the message, the
    warning's line); None for any other shape."""
    for loop in ast.walk(method):
        if not (
            isinstance(loop, ast.For)
            and _dotted(loop.iter) == "os.environ.items()"
            and isinstance(loop.target, ast.Tuple)
            and all(isinstance(e, ast.Name) for e in loop.target.elts)
            and len(loop.target.elts) == 2
        ):
            continue
        name, value = (e.id for e in loop.target.elts)
        for branch in loop.body:
            if isinstance(branch, ast.If) and _compares(branch.test, name, ast.Eq) == ENV:
                return _refusal(branch.body, value)
    return None


def _refusal(body: list[ast.stmt], value: str):
    first = body[0]
    if not isinstance(first, ast.If) or first.orelse:
        return None
    accepted = _compares(first.test, value, ast.NotEq)
    raised = first.body[0] if len(first.body) == 1 else None
    if not isinstance(accepted, str) or not isinstance(raised, ast.Raise):
        return None
    exc = raised.exc
    if not (isinstance(exc, ast.Call) and len(exc.args) == 1):
        return None
    template = _template(exc.args[0], value)
    if template is None:
        return None
    warn_line = next(
        (
            stmt.lineno
            for stmt in body[1:]
            if isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and _dotted(stmt.value.func) in ("logger.warning", "logger.warning_once")
        ),
        None,
    )
    return accepted, raised.lineno, template, warn_line


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c``, or ``a.b.c()`` for a call of it without arguments; None for anything
    else. Read in a loop: ast.unparse recurses, and an expression a file nests a thousand
    deep (which parses) raised RecursionError out of the check."""
    call = isinstance(node, ast.Call) and not node.args and not node.keywords
    node = node.func if call else node
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)]) + ("()" if call else "")


def _compares(test: ast.expr, name: str, op: type) -> object:
    """The constant ``name`` is compared with by ``op`` in ``test``, or None."""
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], op)
        and isinstance(test.left, ast.Name)
        and test.left.id == name
        and isinstance(test.comparators[0], ast.Constant)
    ):
        return test.comparators[0].value
    return None


def _template(node: ast.expr, value: str) -> tuple[str | None, ...] | None:
    """A message made of text and ``{value}``: its parts, None where the value goes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if not isinstance(node, ast.JoinedStr):
        return None
    parts: list[str | None] = []
    for part in node.values:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            parts.append(part.value)
        elif (
            isinstance(part, ast.FormattedValue)
            and isinstance(part.value, ast.Name)
            and part.value.id == value
            and part.conversion == -1
            and part.format_spec is None
        ):
            parts.append(None)
        else:
            return None
    return tuple(parts)


def _replace(choice: RunnerChoice, **changes) -> RunnerChoice:
    import dataclasses

    return dataclasses.replace(choice, **changes)


def _parse(fs: Root, relpath: str) -> ast.Module:
    tree = _parse_present(fs, relpath)
    if tree is None:
        raise _unknown("file-missing", file=relpath)
    return tree


def _parse_present(fs: Root, relpath: str) -> ast.Module | None:
    """``relpath``'s syntax tree; None where the tree has no such file (a file some
    releases lack); Unknown where it is there but cannot be read or parsed."""
    found = fs.lstat(relpath, "runner")
    if found is None:
        return None
    if found.st_size > MAX_SOURCE_BYTES:
        raise _unknown("file-too-large", file=relpath, limit=MAX_SOURCE_BYTES)
    data = fs.read(relpath, "runner")
    if data is None or len(data) > MAX_SOURCE_BYTES:
        raise _unknown("file-unreadable", file=relpath)
    try:
        return ast.parse(data.decode("utf-8"), filename=relpath)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
        # RecursionError, MemoryError: CPython's parser on an expression nested thousands deep
        raise _unknown("file-unparsable", file=relpath, error=type(exc).__name__) from None


_ABSENT = object()


def _env_default(tree: ast.Module):
    """The variable's default as vLLM reads it: False ("0"), None (unset) or _ABSENT."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "getenv"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == ENV
        ):
            if len(node.args) != 2 or not isinstance(node.args[1], ast.Constant):
                raise _unknown("default-not-constant", node.lineno, file=ENVS, env=ENV)
            default = node.args[1].value
            if default is None:
                return None
            if isinstance(default, str) and default.strip().lstrip("-").isdigit():
                return bool(int(default))
            raise _unknown(
                "default-not-understood", node.lineno, file=ENVS, env=ENV, value=repr(default)
            )
    return _ABSENT


# -- the configuration the interpreter knows --------------------------------------------

_OFF = object()  # a setting left off (None, False, 0 or empty, as the code tests it)


class _Obj:
    """An object of the configuration: known attributes only."""

    def __init__(self, name: str, attrs: dict):
        self.name, self.attrs = name, attrs

    def get(self, attr: str, line: int):
        if attr not in self.attrs:
            raise _unknown("attribute", line, name=f"{self.name}.{attr}")
        return self.attrs[attr]


_MODEL = _Obj(
    "model_config",
    {
        "runner_type": "generate",
        "architectures": ARCHITECTURES,
        "is_hybrid": True,
        "has_inner_state": True,
        "is_attention_free": False,
        "is_diffusion": False,
        "is_moe": None,  # Qwen3.5 comes dense and MoE: code that needs it gives unknown
        "is_quantized": None,
        "enable_return_routed_experts": False,
        "enable_prompt_embeds": False,
        "logits_processors": None,
        "logprobs_mode": "raw_logprobs",
    },
)
_SETTINGS = {
    "model_config": _MODEL,
    "lora_config": _Obj("lora_config", {}),  # --enable-lora: present
    "speculative_config": None,
    "reasoning_config": None,
    "ec_transfer_config": None,
    "kv_transfer_config": None,
    "attention_config": _Obj("attention_config", {"hisparse_config": None}),
    "watermark_config": None,
    "parallel_config": _Obj(
        "parallel_config",
        {
            "prefill_context_parallel_size": 1,
            "decode_context_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "enable_dbo": False,
            "use_ubatching": False,
            "enable_elastic_ep": False,
            "distributed_executor_backend": None,
        },
    ),
    "cache_config": _Obj(
        "cache_config", {"kv_sharing_fast_prefill": False, "mamba_cache_mode": "none"}
    ),
    "compilation_config": _Obj(
        "compilation_config",
        {"mode": "VLLM_COMPILE", "pass_config": _Obj("pass_config", {"enable_sp": False})},
    ),
}
_PLATFORM = _Obj("current_platform", {})
_OFF_CALLS = {"is_rocm", "is_xpu", "is_cpu", "is_tpu"}  # current_platform on CUDA
_LOGGER_CALLS = {"warning_once", "info_once", "debug_once", "warning", "info", "debug"}


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class _Config:
    """VllmConfig's methods, run on the configuration above."""

    def __init__(self, tree: ast.Module):
        self.functions: dict[str, ast.FunctionDef] = {}
        self.constants: dict[str, object] = {}
        self.methods: dict[str, ast.FunctionDef] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id.isupper():
                    self.constants[target.id] = node.value
            elif isinstance(node, ast.ClassDef) and node.name == "VllmConfig":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.methods[item.name] = item
        self.env: bool | None = None
        self.steps = 0

    def runner(self, env: bool | None) -> tuple[str, Reason]:
        """``(runner, why)`` with the variable at ``env``: v1, v2, or refused."""
        self.env, self.steps = env, 0
        value = None if env is None else int(env)
        if "use_v2_model_runner" not in self.methods:
            # 0.17-0.21: the worker takes the variable as it is.
            if env and "_validate_v2_model_runner" in self.methods:
                refused = self._refusal("_validate_v2_model_runner")
                if refused:
                    return "refused", refused
            return (V2 if env else V1), Reason.of(
                Code.RUNNER_NO_CONFIG_SWITCH, env=ENV, value=value
            )
        try:
            chose = self.call_method("use_v2_model_runner", [])
        except _Refused as exc:
            return "refused", exc.reason
        if not isinstance(chose, bool):
            raise _unknown("not-a-bool", value=repr(chose))
        if chose and "_validate_v2_model_runner" in self.methods:
            refused = self._refusal("_validate_v2_model_runner")
            if refused:
                return "refused", refused
        where = self.methods["use_v2_model_runner"].lineno
        return (V2 if chose else V1), Reason.of(
            Code.RUNNER_BY_CONFIG, env=ENV, value=value, file=CONFIG, line=where
        )

    def _refusal(self, name: str) -> Reason | None:
        try:
            self.call_method(name, [])
        except _Refused as exc:
            return exc.reason
        return None

    # -- calls ---------------------------------------------------------------------------
    def call_method(self, name: str, args: list):
        return self._run(self.methods[name], args, {"self": "self"})

    def _run(self, function: ast.FunctionDef, args: list, scope: dict):
        if args or len(function.args.args) != len(scope):
            raise _unknown("takes-arguments", function.lineno, name=function.name)
        local = dict(scope)
        try:
            self.block(function.body, local)
        except _Return as ret:
            return ret.value
        return None

    # -- statements ----------------------------------------------------------------------
    def block(self, body: list[ast.stmt], local: dict) -> None:
        for stmt in body:
            self.statement(stmt, local)

    def statement(self, stmt: ast.stmt, local: dict) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _unknown("too-many-steps", limit=MAX_STEPS)
        if isinstance(stmt, ast.Return):
            raise _Return(None if stmt.value is None else self.expr(stmt.value, local))
        if isinstance(stmt, ast.If):
            test = self.expr(stmt.test, local)
            self.block(stmt.body if self.truth(test, stmt.test) else stmt.orelse, local)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if not all(isinstance(t, ast.Name) for t in targets) or stmt.value is None:
                raise _unknown("assignment", stmt.lineno)
            value = self.expr(stmt.value, local)
            for target in targets:
                local[target.id] = value
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                local[alias.asname or alias.name] = (
                    _PLATFORM if alias.name == "current_platform" else ("imported", alias.name)
                )
        elif isinstance(stmt, ast.Raise):
            raise _Refused(self._refused(stmt, local))
        elif isinstance(stmt, ast.Expr):
            self.expression_statement(stmt, local)
        elif not isinstance(stmt, ast.Pass):
            raise _unknown("statement", stmt.lineno, node=type(stmt).__name__)

    def expression_statement(self, stmt: ast.Expr, local: dict) -> None:
        value = stmt.value
        if isinstance(value, ast.Constant):
            return  # a docstring
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            owner, attr = value.func.value, value.func.attr
            if isinstance(owner, ast.Name) and owner.id == "logger" and attr in _LOGGER_CALLS:
                return
            if isinstance(owner, ast.Name) and attr in ("append", "extend"):
                target = local.get(owner.id)
                if isinstance(target, list) and len(value.args) == 1:
                    item = self.expr(value.args[0], local)
                    target.append(item) if attr == "append" else target.extend(item)
                    return
        self.expr(value, local)

    def _refused(self, stmt: ast.Raise, local: dict) -> Reason:
        """``runner-refused``: vLLM's own message (``raised``) where this check can make
        it, else null, and where vLLM raises."""
        exc, text = stmt.exc, None
        if isinstance(exc, ast.Call) and exc.args:
            try:
                text = self.expr(exc.args[0], local)
            except Unknown:
                text = None
        raised = text if isinstance(text, str) else None
        return Reason.of(Code.RUNNER_REFUSED, raised=raised, file=CONFIG, line=stmt.lineno)

    # -- expressions ---------------------------------------------------------------------
    def truth(self, value, node: ast.AST) -> bool:
        if value is None and isinstance(node, ast.Attribute) and node.attr in ("is_moe",):
            raise _unknown("depends-on-moe", node.lineno)
        if isinstance(value, _Obj):
            return True
        if isinstance(value, tuple) and value[:1] == ("unknown",):
            raise _unknown("unknown-value", node.lineno, detail=value[1])
        return bool(value)

    def expr(self, node: ast.expr, local: dict):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.name(node, local)
        if isinstance(node, ast.Attribute):
            return self.attribute(node, local)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.truth(self.expr(node.operand, local), node.operand)
        if isinstance(node, ast.BoolOp):
            is_and = isinstance(node.op, ast.And)
            for operand in node.values:
                value = self.expr(operand, local)
                if self.truth(value, operand) != is_and:
                    return value
            return value
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            return self.compare(node, local)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = [self.expr(e, local) for e in node.elts]
            return values if isinstance(node, ast.List) else frozenset(values)
        if isinstance(node, ast.JoinedStr):
            return "".join(
                str(self.expr(v.value, local)) if isinstance(v, ast.FormattedValue) else v.value
                for v in node.values
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left, right = self.expr(node.left, local), self.expr(node.right, local)
            try:
                return left + right if isinstance(node.op, ast.Add) else left - right
            except TypeError:
                raise _unknown("operation", line) from None
        if isinstance(node, ast.Call):
            return self.call(node, local)
        raise _unknown("expression", line, node=type(node).__name__)

    def name(self, node: ast.Name, local: dict):
        if node.id in local:
            return local[node.id]
        if node.id == "HAS_TRITON":
            return True  # vLLM on CUDA ships Triton
        if node.id in self.constants:
            return self.expr(self.constants[node.id], {})
        if node.id in ("envs",):
            return ("module", "envs")
        if node.id == "CompilationMode":
            return ("enum", "CompilationMode")
        raise _unknown("name", node.lineno, name=node.id)

    def attribute(self, node: ast.Attribute, local: dict):
        owner = self.expr(node.value, local)
        if owner == "self":
            if node.attr not in _SETTINGS:
                raise _unknown("attribute", node.lineno, name=f"self.{node.attr}")
            return _SETTINGS[node.attr]
        if owner == ("module", "envs"):
            if node.attr != ENV:
                raise _unknown("other-env", node.lineno, name=f"envs.{node.attr}")
            return self.env
        if owner == ("enum", "CompilationMode"):
            return node.attr
        if isinstance(owner, _Obj):
            return owner.get(node.attr, node.lineno)
        raise _unknown("attribute-of-unknown", node.lineno, name=node.attr)

    def compare(self, node: ast.Compare, local: dict):
        left = self.expr(node.left, local)
        right = self.expr(node.comparators[0], local)
        op = node.ops[0]
        if (
            left is None
            and isinstance(node.left, ast.Attribute)
            and node.left.attr
            in (
                "is_moe",
                "is_quantized",
            )
        ):
            raise _unknown("depends-on-model", node.lineno, name=f"model_config.{node.left.attr}")
        if isinstance(op, ast.Is):
            return left is right
        if isinstance(op, ast.IsNot):
            return left is not right
        if isinstance(op, ast.Eq):
            return left == right
        if isinstance(op, ast.NotEq):
            return left != right
        if isinstance(op, (ast.In, ast.NotIn)):
            if not isinstance(right, (frozenset, list, tuple, str)):
                raise _unknown("in-over-unknown", node.lineno)
            return (left in right) == isinstance(op, ast.In)
        if isinstance(op, (ast.Gt, ast.GtE, ast.Lt, ast.LtE)) and all(
            isinstance(v, int) for v in (left, right)
        ):
            return {ast.Gt: left > right, ast.GtE: left >= right, ast.Lt: left < right}.get(
                type(op), left <= right
            )
        raise _unknown("comparison", node.lineno)

    def call(self, node: ast.Call, local: dict):
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "join"
            and isinstance(func.value, ast.Constant)
            and isinstance(func.value.value, str)
            and len(node.args) == 1
        ):
            return func.value.value.join(str(v) for v in self.expr(node.args[0], local))
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id == "self" and func.attr in self.methods:
                return self.call_method(func.attr, node.args)
            if local.get(func.value.id) is _PLATFORM and func.attr in _OFF_CALLS and not node.args:
                return False
        if isinstance(func, ast.Name):
            if func.id == "getattr" and len(node.args) in (2, 3):
                owner = self.expr(node.args[0], local)
                attr = self.expr(node.args[1], local)
                if owner == "self" and isinstance(attr, str):
                    if attr in _SETTINGS:
                        return _SETTINGS[attr]
                    raise _unknown("getattr", node.lineno, name=attr)
                if isinstance(owner, _Obj) and isinstance(attr, str):
                    return owner.get(attr, node.lineno)
            if func.id == "frozenset" and len(node.args) == 1:
                return frozenset(self.expr(node.args[0], local))
            if func.id == "any" and len(node.args) == 1:
                return self.any(node.args[0], local)
            if func.id == "bool" and len(node.args) == 1:
                inner = node.args[0]
                if self._entry_points(inner, local):
                    return False  # no vllm.logits_processors plugin installed (vLLM's default)
                return self.truth(self.expr(inner, local), inner)
            if func.id in self.functions and not node.args:
                return self._run(self.functions[func.id], [], {})
        raise _unknown("call", node.lineno)

    def _entry_points(self, node: ast.expr, local: dict) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and local.get(node.func.id) == ("imported", "entry_points")
        )

    def any(self, node: ast.expr, local: dict) -> bool:
        if not (isinstance(node, ast.GeneratorExp) and len(node.generators) == 1):
            raise _unknown("any-over-unknown", node.lineno)
        gen = node.generators[0]
        if not isinstance(gen.target, ast.Name) or gen.ifs or gen.is_async:
            raise _unknown("any-over-unknown", node.lineno)
        for item in self.expr(gen.iter, local):
            inner = dict(local, **{gen.target.id: item})
            if self.truth(self.expr(node.elt, inner), node.elt):
                return True
        return False
