"""The shapes a LoRA adapter must fit, read from a model's config.json alone.

No weights are needed: an admission check runs where only the config is at
hand (an init container, a registry hook). The shapes are transformers'
Qwen3.5/3.6 and Qwen3-Next modules as PEFT names them (the checkpoint's
names, before vLLM fuses anything): every layer has input/output sizes
fixed by the config, and ``layer_types`` says which layers are Gated
DeltaNet (``linear_attention``) and which full attention. The widths:

- attention: q_proj (2 * heads * head_dim, hidden) with Qwen3.5's output
  gate (``attn_output_gate``, on unless the config turns it off), k_proj and
  v_proj (kv_heads * head_dim, hidden), o_proj (hidden, heads * head_dim);
- GDN: in_proj_qkv (2 * key_heads * key_dim + value_heads * value_dim,
  hidden), in_proj_z (value_heads * value_dim, hidden), in_proj_b and
  in_proj_a (value_heads, hidden), out_proj (hidden, value_heads * value_dim);
- dense MLP: gate_proj/up_proj (intermediate, hidden), down_proj (hidden,
  intermediate);
- MoE: router gate (experts, hidden), experts.gate_up_proj (E, 2 *
  moe_intermediate, hidden) and experts.down_proj (E, hidden,
  moe_intermediate), per-expert experts.N.{gate,up,down}_proj, shared_expert
  like a dense MLP at shared_expert_intermediate_size, shared_expert_gate
  (1, hidden);
- embed_tokens and lm_head (vocab, hidden).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.codes import Code
from patchkit.errors import FileProblem

# The architectures whose module widths this file knows (config.json "architectures").
KNOWN = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class ModelShapes:
    """What the model has: per layer kind, module name -> (out, in); experts as (E, out, in)."""

    architecture: str
    layers: int
    layer_types: list[str]
    vocab: int
    hidden: int
    attention: dict[str, tuple[int, int]] = field(default_factory=dict)
    gdn: dict[str, tuple[int, int]] = field(default_factory=dict)
    mlp: dict[str, tuple[int, int]] = field(default_factory=dict)  # dense, or shared_expert.*
    experts: int = 0  # routed experts; 0 for a dense model
    expert_params: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    expert_proj: dict[str, tuple[int, int]] = field(default_factory=dict)  # one expert's

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def module_names(self) -> set[str]:
        """Every last name a PEFT target_modules entry can match in the language model."""
        names = set(self.attention) | set(self.gdn) | {"embed_tokens", "lm_head"}
        if self.moe:
            names |= {"gate", "shared_expert_gate", "experts"} | set(MLP)
        else:
            names |= set(self.mlp)
        return names

    def layer_modules(self, layer: int) -> dict[str, tuple[int, int]]:
        """(out, in) of each 2-D module of one decoder layer, by its name under the layer."""
        kind = self.layer_types[layer] if layer < len(self.layer_types) else "full_attention"
        mixer = (
            {f"linear_attn.{k}": v for k, v in self.gdn.items()}
            if kind == "linear_attention"
            else {f"self_attn.{k}": v for k, v in self.attention.items()}
        )
        if not self.moe:
            return mixer | {f"mlp.{k}": v for k, v in self.mlp.items()}
        moe = {f"mlp.shared_expert.{k}": v for k, v in self.mlp.items()}
        moe["mlp.gate"] = (self.experts, self.hidden)
        moe["mlp.shared_expert_gate"] = (1, self.hidden)
        return mixer | moe


# Bounds of a config's sizes: past them it describes no model (the largest have a few
# hundred layers and widths below a million), and a layer count of 9e18 once made the
# layer list exhaust memory from a 200-byte config.json.
MAX_LAYERS = 1 << 12
MAX_WIDTH = 1 << 24


class ModelConfigInvalid(FileProblem):
    """A model's config.json that says no model patchkit can size (a width that is no
    integer, or past any model's): ``path``, ``detail``, and the ``key``."""

    code = Code.MODEL_CONFIG_INVALID


def _int(cfg: dict, key: str, where: str, default: int | None = None, most: int = MAX_WIDTH) -> int:
    value = cfg.get(key, default)
    if type(value) is not int or not 0 < value <= most:
        shown = repr(value)[:40]
        raise ModelConfigInvalid(
            where, f"{key} is {shown}; an integer from 1 to {most} expected", key=key
        )
    return value


def text_config(config: dict) -> dict:
    """The language model's settings: ``text_config`` of a VL wrapper, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def architecture(config: dict) -> str:
    archs = config.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs else ""
    return first if isinstance(first, str) else ""


def model_shapes(config: dict, where: str) -> ModelShapes | None:
    """The widths of a Qwen3.5/3.6 or Qwen3-Next model; None for another architecture."""
    arch = architecture(config)
    if arch not in KNOWN:
        return None
    t = text_config(config)
    hidden = _int(t, "hidden_size", where)
    layers = _int(t, "num_hidden_layers", where, most=MAX_LAYERS)
    heads = _int(t, "num_attention_heads", where)
    kv_heads = _int(t, "num_key_value_heads", where)
    head_dim = _int(t, "head_dim", where, hidden // heads)
    types = t.get("layer_types")
    if not (isinstance(types, list) and len(types) == layers):
        interval = _int(t, "full_attention_interval", where, 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    gate = 2 if t.get("attn_output_gate", True) else 1
    shapes = ModelShapes(arch, layers, list(types), _int(t, "vocab_size", where), hidden)
    shapes.attention = {
        "q_proj": (gate * heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
    }
    if "linear_attention" in types:
        nk, nv = _int(t, "linear_num_key_heads", where), _int(t, "linear_num_value_heads", where)
        dk, dv = _int(t, "linear_key_head_dim", where), _int(t, "linear_value_head_dim", where)
        shapes.gdn = {
            "in_proj_qkv": (2 * nk * dk + nv * dv, hidden),
            "in_proj_z": (nv * dv, hidden),
            "in_proj_b": (nv, hidden),
            "in_proj_a": (nv, hidden),
            "out_proj": (hidden, nv * dv),
        }
    if "num_experts" in t or "Moe" in arch or "Next" in arch:
        experts = _int(t, "num_experts", where)
        inter = _int(t, "moe_intermediate_size", where)
        shared = _int(t, "shared_expert_intermediate_size", where)
        shapes.experts = experts
        shapes.expert_params = {
            "gate_up_proj": (experts, 2 * inter, hidden),
            "down_proj": (experts, hidden, inter),
        }
        shapes.expert_proj = {
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
        }
        size = shared
    else:
        size = _int(t, "intermediate_size", where)
    shapes.mlp = {
        "gate_proj": (size, hidden),
        "up_proj": (size, hidden),
        "down_proj": (hidden, size),
    }
    return shapes
