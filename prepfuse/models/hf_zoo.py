"""Every decoder attention of the installed transformers, run the way engines run them: the
zoo that ``bench/tools/survey_transformers.py`` surveys (``prepfuse.models.clients`` hand-picks
a few families; this finds them all).

A model is one family's text-decoder self-attention class, found by these rules (``discover``):

1. Entry points are the classes of the causal-LM, image-text-to-text and multimodal-LM auto
   mappings. The decoder config is the entry class's config, or its ``text_config``
   sub-config (a VLM's language model); a ``text_config`` that is any ``AutoConfig`` borrows
   another family's decoder, counted there.
2. Its attention classes are those the decoder config's model classes record as their
   ``attentions`` (``_can_record_outputs``): the text decoder layers' modules, never a vision
   or audio tower's (those have configs of their own). Where they record none (Moshi,
   MusicGen, PaddleOCR-VL's text), every ``*Attention`` class of the modeling module.
3. Kept are the classes whose ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS`` (its
   source names it or ``attention_interface``) and whose names say none of ``Cross``,
   ``Encoder``, ``Code2Wav``, ``Vision``, ``Audio``, ``DiT`` (cross-attention; a diffusion LM's
   bidirectional encoder; vocoders and towers), and that a model class of the decoder config
   builds; at build, its modules in a cross-attention's place or in an encoder (where the
   model has a decoder) are not used.
4. A class reached from several model types (``gemma3`` and ``gemma3_text``, ``gpt2`` and
   ``gpt-sw3``) is one model; a modular copy in another family is a class, and model, of its own.

Built (``build_zoo_model``) as ``clients.build_client`` builds a case: a tiny config (``_TINY``:
hidden 256, 4 q heads, 2 kv heads, head_dim 64, MLA and MoE sizes alike, where the family's
config has such fields), the family's decoder model built from it, and of that model the first
two self-attention modules and the rotary module, which computes cos/sin in the forward as the
decoder does. The attention function is ``ZOO_ATTENTION``: ``clients``' engine function with k
and v each of its own head dim and paged cache (MLA's differ).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from prepfuse.models.clients import causal_gqa_attention

__all__ = ["ZOO_ATTENTION", "ZooLayers", "ZooModel", "build_zoo_model", "discover", "register_zoo_attention",
           "zoo_cache_rows"]

ZOO_ATTENTION = "prepfuse_paged_zoo"  # the name the zoo's engine attention function is registered under
_ENTRIES = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")
_SKIPPED_NAMES = ("Cross", "Encoder", "Code2Wav", "Vision", "Audio", "DiT")
_TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=64,
             max_position_embeddings=4096, vocab_size=512, q_lora_rank=96, kv_lora_rank=128, qk_rope_head_dim=64,
             qk_nope_head_dim=64, v_head_dim=128, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
             zero_expert_num=1, expert_ffn_hidden_size=32, num_kv_shared_layers=0, is_decoder=True)
_OFF_SWITCHES = ("q_lora_rank", "kv_lora_rank")  # None turns the feature off, so stays None (0 does for any field)
_FAMILY_FIELDS = {  # what no rule covers; a "*layer_types" entry is the kinds of layer to cycle
    "BambaConfig": {"attn_layer_indices": [0, 1]},  # no attention layer by default
    "GraniteMoeHybridConfig": {"layer_types": ["full_attention", "linear_attention"]},  # likewise
    "Lfm2MoeConfig": {"layer_types": ["full_attention", "conv"]},  # None by default: a checkpoint's
    "DeepseekOcr2TextConfig": {"mlp_layer_types": ["dense"]},  # likewise
    "ChameleonConfig": {"vocabulary_map": {"<image>": 0}},  # likewise, and read at build
}
_MISSING = object()


def _zoo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``clients._engine_attention`` for any k and v: the step's k ``[B, Hkv, S, Dk]`` and v
    ``[B, Hkv, S, Dv]`` into their own paged caches ``[num_blocks, block_size, Hkv, D]`` by index
    assignment, then causal SDPA over the step's tokens (GQA by repeating kv heads). Given
    ``kv_shapes`` (a list) instead of caches, it appends ``(Hkv, Dk, Dv)`` and writes nothing;
    given ``seen`` (a dict), it keeps the step's q, k and v there (``hf_zoo_limits``)."""
    batch, kv_heads, seq, _ = key.shape
    if seq != query.shape[2]:  # the cache takes the step's rows, one a token
        raise ValueError(f"k has {seq} rows for the step's {query.shape[2]} tokens (rows the module adds: "
                         "compressed or sink tokens); the engine's cache write takes one a token")
    if "kv_shapes" in kwargs:
        kwargs["kv_shapes"].append((kv_heads, key.shape[-1], value.shape[-1]))
    elif "seen" in kwargs:
        kwargs["seen"].update(q=query, k=key, v=value)
    else:
        k_cache, v_cache, slots, block_size = (kwargs[k] for k in ("k_cache", "v_cache", "slot_mapping", "block_size"))
        k_cache[slots // block_size, slots % block_size] = key.transpose(1, 2).reshape(batch * seq, kv_heads, -1)
        v_cache[slots // block_size, slots % block_size] = value.transpose(1, 2).reshape(batch * seq, kv_heads, -1)
    return causal_gqa_attention(query, key, value, scaling), None


def register_zoo_attention() -> None:
    """Register ``_zoo_attention`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ZOO_ATTENTION, _zoo_attention)


@dataclass(frozen=True)
class ZooModel:
    """One family's text-decoder self-attention, and what builds it."""

    name: str  # the family, or the model type where a family gives several models
    family: str  # transformers.models.<family>
    module: str  # the modeling module that defines the attention class
    attention: str  # the attention class
    config: str  # the decoder config class
    model_class: str  # the model class built to get the layers (the decoder's base model)
    model_type: str  # the first model type it was reached from
    rotary: str | None  # the rotary class (None: none found, no RoPE or RoPE inside the attention)

    @property
    def source(self) -> str:
        return f"{self.module}.{self.attention}"


def _recorded_attentions(model_cls) -> list[type]:
    recorded = (getattr(model_cls, "_can_record_outputs", None) or {}).get("attentions")
    return [getattr(r, "target_class", r) for r in (recorded if isinstance(recorded, list) else [recorded] if recorded else [])]


def _dispatches(cls) -> bool:
    source = inspect.getsource(cls.forward)
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _decoder_config(class_name):
    """The decoder config class of an entry class, or None (another family's decoder)."""
    import transformers

    names = class_name if isinstance(class_name, (list, tuple)) else [class_name]
    config = next((c.config_class for c in (getattr(transformers, n, None) for n in names) if c is not None), None)
    text = (getattr(config, "sub_configs", None) or {}).get("text_config", config)
    return text if inspect.isclass(text) and text.__name__ != "AutoConfig" else None


def _model_class(module, config_cls, attention, recorded: bool) -> type | None:
    """The decoder's base model class (``MODEL_MAPPING_NAMES``), else another concrete model
    class of ``module`` built from ``config_cls`` (that records ``attention``, if ``recorded``)."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = getattr(module, str(MODEL_MAPPING_NAMES.get(getattr(config_cls, "model_type", ""))), None)
    classes = [base] + [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, PreTrainedModel)]
    return next((c for c in classes if c is not None and not c.__name__.endswith("PreTrainedModel")
                 and c.config_class is config_cls and (not recorded or attention in _recorded_attentions(c))), None)


def _rotary_name(module, model_cls, attention) -> str | None:
    """The rotary class the model (else the attention) builds, else the module's only text one."""
    for cls in (model_cls, attention):
        found = re.search(r"(\w+RotaryEmbedding)\(", inspect.getsource(cls.__init__))
        if found:
            return found.group(1)
    text = [n for n in vars(module) if n.endswith("RotaryEmbedding") and not re.search("Vision|Audio", n)]
    return text[0] if len(text) == 1 else None


def discover(excluded: dict[str, str] | None = None) -> list[ZooModel]:
    """Every text-decoder self-attention of the installed transformers, by the module
    docstring's rules, in entry-point order; a class reached twice is listed once. Given
    ``excluded``, each entry model type that adds no model is put there with why."""
    import transformers.models.auto.modeling_auto as auto

    found: dict[type, ZooModel] = {}
    excluded = {} if excluded is None else excluded
    entries = {t: c for mapping in reversed(_ENTRIES) for t, c in getattr(auto, mapping, {}).items()}
    for model_type in dict.fromkeys(t for mapping in _ENTRIES for t in getattr(auto, mapping, {})):
        config_cls, why = _decoder_config(entries[model_type]), []
        if config_cls is None:
            excluded[model_type] = "its text_config is any AutoConfig: another family's decoder"
            continue
        try:
            module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
        except ImportError as err:
            excluded[model_type] = f"its modeling module does not import here: {err}"
            continue
        recorded = list(dict.fromkeys(a for c in vars(module).values() if inspect.isclass(c)
                                      and getattr(c, "config_class", None) is config_cls for a in _recorded_attentions(c)))
        candidates = recorded or [c for n, c in vars(module).items() if n.endswith("Attention") and inspect.isclass(c)
                                  and c.__module__ == module.__name__ and hasattr(c, "forward")]
        for attention in candidates:
            skipped = next((s for s in _SKIPPED_NAMES if s in attention.__name__), None)
            model_cls = None if attention in found or skipped or not _dispatches(attention) else \
                _model_class(module, config_cls, attention, bool(recorded))
            if model_cls is not None:
                family, taken = module.__name__.split(".")[2], {m.name for m in found.values()}
                name = next(n for n in (family, model_type, f"{model_type}-{attention.__name__}") if n not in taken)
                found[attention] = ZooModel(name, family, module.__name__, attention.__name__, config_cls.__name__,
                                            model_cls.__name__, model_type, _rotary_name(module, model_cls, attention))
                continue
            twin = found.get(attention)
            why.append(f"{attention.__name__}: " + (f"model {twin.name}'s, reached from {twin.model_type}" if twin
                       else f"its name says {skipped}" if skipped else "no model class builds it" if _dispatches(
                           attention) else "its forward does not dispatch through the attention interface"))
        if not any(m.model_type == model_type for m in found.values()):
            excluded[model_type] = "; ".join(why) or "its modeling module has no attention class"
    return list(found.values())


def _field(config, key: str):
    try:
        return getattr(config, key)
    except Exception:  # noqa: BLE001  (absent; or per-layer only: Gemma-4's heterogeneous configs raise their own)
        return _MISSING


def _head_dim(config, **fields) -> int:
    """``config``'s head dim with ``fields`` set."""
    get = lambda key: fields.get(key, getattr(config, key, None))  # noqa: E731
    return get("head_dim") or get("hidden_size") // get("num_attention_heads")


def _scaled(sections: list[int], total: int) -> list[int]:
    """M-RoPE sections scaled to sum to ``total``."""
    scaled = [s * total // sum(sections) for s in sections]
    return scaled[:-1] + [total - sum(scaled[:-1])]


def _tiny_fields(config_cls, layers: int, source: str) -> dict:
    """The ``_TINY`` sizes ``config_cls`` has fields for (a default off switch stays off), MLA's
    head_dim tied to its parts as the defaults tie it, ``layers`` hidden layers, each per-layer
    list cut to them (a ``*layer_types`` one cycled over the family's kinds of layer), the
    family's ``_FAMILY_FIELDS``, M-RoPE sections (the config's, else the default the rotary's
    ``source`` reads) scaled to the tiny rotated half, vocabularies and token ids tiny;
    sub-configs (BLT's parts) shrunk alike. Keys as the config's ``attribute_map`` names them."""
    defaults, family = config_cls(), _FAMILY_FIELDS.get(config_cls.__name__, {})
    depth = _field(defaults, "num_hidden_layers")
    fields = {k: v for k, v in _TINY.items()
              if _field(defaults, k) not in (_MISSING, 0) and not (k in _OFF_SWITCHES and _field(defaults, k) is None)}
    rope, head = _field(defaults, "qk_rope_head_dim"), _field(defaults, "head_dim")
    if "qk_rope_head_dim" in fields and head is not _MISSING and head in (rope, _field(defaults, "qk_head_dim")):
        fields["head_dim"] = fields["qk_rope_head_dim"] + (fields.get("qk_nope_head_dim", 0) if head != rope else 0)
    fields.update({k: _tiny_fields(c, layers, source) for k, c in (getattr(config_cls, "sub_configs", None)
                   or {}).items() if inspect.isclass(c) and c.__name__ != "AutoConfig"})
    fields.update(family, **{k: layers for k in ("num_hidden_layers", "num_layers") if _field(defaults, k) is not _MISSING})
    source_sections = re.search(r'"mrope_section", (\[[\d, ]+\])\)', source)
    for key, value in vars(defaults).items():
        per_layer = isinstance(value, list) and len(value) == depth and depth > 1
        if key.endswith("layer_types") and (key in family or per_layer):
            kinds = family.get(key) or list(dict.fromkeys(value))
            fields[key] = [kinds[i % len(kinds)] for i in range(layers)]
        elif per_layer:
            fields[key] = [value[i % len(value)] for i in range(layers)]
        elif key == "rope_parameters" and "rope_type" in (value or {}) and ("mrope_section" in value or source_sections):
            sections = value.get("mrope_section") or ast.literal_eval(source_sections.group(1))
            partial = value.get("partial_rotary_factor", getattr(defaults, "partial_rotary_factor", None) or 1.0)
            fields[key] = {**value, "mrope_section": _scaled(  # they cover the rotated half-dims
                sections, int(_head_dim(defaults, **fields) * partial) // 2)}
        elif isinstance(value, int) and not isinstance(value, bool) and value >= _TINY["vocab_size"] and (
                "vocab" in key or key.endswith("_token_id")):  # BLT's hash vocabulary too
            fields[key] = _TINY["vocab_size"] if "vocab" in key else 0
    names = getattr(config_cls, "attribute_map", None) or {}
    return {names.get(k, k): v for k, v in fields.items()}


def _tiny_config(config_cls, layers: int, source: str = ""):
    """``config_cls(**_tiny_fields(...))``; a size the family's own validation rejects (named in
    its error) keeps its default, and kv heads it wants equal to the q heads become so."""
    fields = _tiny_fields(config_cls, layers, source)
    for _ in range(4):
        try:
            return config_cls(**fields)
        except Exception as err:  # noqa: BLE001  (configs raise ValueError, TypeError, their own)
            named = [k for k in fields if k in _TINY and re.search(rf"\b{k}\b", str(err))]
            if not named:
                raise
            if "num_key_value_heads" in named and fields["num_key_value_heads"] != fields.get("num_attention_heads"):
                fields["num_key_value_heads"] = fields.get("num_attention_heads", _TINY["num_attention_heads"])
            else:
                fields.pop(named[-1])
    return config_cls(**fields)


def _build(module, model: ZooModel, num_layers: int) -> tuple[nn.Module, list[nn.Module]]:
    """(the model built from the tiny config, ``num_layers`` of its self-attention modules), with
    more layers where the first have too few (a hybrid's attention layers may be far apart)."""
    config_cls, attention = getattr(module, model.config), getattr(module, model.attention)
    source = inspect.getsource(getattr(module, model.rotary)) if model.rotary else ""
    kinds = _FAMILY_FIELDS.get(model.config, {}).get("layer_types") or _field(config_cls(), "layer_types")
    for count in (num_layers * len(set(kinds if isinstance(kinds, list) else [None])), 8, 16, 32):
        built = getattr(module, model.model_class)(_tiny_config(config_cls, max(count, num_layers), source))
        # not a cross-attention, nor an encoder's where there is a decoder (BERT's decoder stack is its "encoder")
        paths = [n.lower() for n, _ in built.named_modules()]
        named = [(n.lower(), m) for n, m in built.named_modules() if type(m) is attention
                 and not getattr(m, "is_cross_attention", False) and "cross" not in n.lower()]
        layers = [m for n, m in named if "encoder" not in n or not any("decoder" in p for p in paths)][:num_layers]
        if len(layers) == num_layers:
            return built, layers
    raise ValueError(f"{len(layers)} {model.attention} self-attention modules in {model.model_class} of up to "
                     f"32 layers, {num_layers} wanted")


def _nearest(built: nn.Module, name: str | None, layer: nn.Module) -> nn.Module | None:
    """The module of class ``name`` in ``built`` nearest ``layer`` (BLT has a rotary a part)."""
    paths = {m: p.split(".") for p, m in built.named_modules()}
    found = [m for m in paths if type(m).__name__ == name]
    return max(found, key=lambda m: len(os.path.commonprefix([paths[m], paths[layer]])), default=None)


def _layer_type(layer: nn.Module):
    types = getattr(layer.config, "layer_types", None)
    return getattr(layer, "layer_type", None) or (types[layer.layer_idx] if types else None)


class ZooLayers(nn.Module):
    """A family's attention modules and its rotary module, run as ``clients._EngineLayers``
    runs them: cos/sin from the step's positions once per rope type (Gemma-3's layer types;
    DeepSeek-V4's main and compress tables, handed over as the dict its attention picks from;
    M-RoPE's position grids all equal, as for text), each layer's step into its own caches,
    residual between layers. The causal mask (bool) goes only to an attention with a sparse
    indexer, which reads it; the others get None, as engines pass it."""

    def __init__(self, layers: list[nn.Module], rotary: nn.Module | None, block_size: int):
        super().__init__()
        self.layers, self.rotary, self.block_size = nn.ModuleList(layers), rotary, block_size
        found = rotary is not None and re.search(r"\.expand\((\d+|len\(self\.mrope_section\)), position_ids\.shape\[1\]",
                                     inspect.getsource(type(rotary).forward))
        self.grids = found and (len(rotary.mrope_section) if found.group(1).startswith("len") else int(found.group(1)))
        self.rope_types: list = [None]
        if rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
            params = getattr(layers[0].config, "rope_parameters", None) or {}
            typed = [k for k, v in params.items() if isinstance(v, dict)]  # per-type rope parameters
            used = list(dict.fromkeys(_layer_type(layer) for layer in layers))
            self.rope_types = [t for t in used if t in typed] or typed or used
        self.types = [_layer_type(layer) if self.rope_types != [None] else None for layer in layers]
        self.params = [set(inspect.signature(layer.forward).parameters) for layer in layers]
        self.reads_mask = [any("indexer" in n for n, _ in layer.named_modules()) for layer in layers]
        self.kv_shapes: list[tuple[int, int, int]] = []  # per layer (Hkv, Dk, Dv), once probed

    def forward(self, x, position_ids, slot_mapping, caches):
        tables = {}
        if self.rotary is not None:
            grid = position_ids[None].expand(self.grids, *position_ids.shape) if self.grids else position_ids
            tables = {t: self.rotary(x, grid) if t is None else self.rotary(x, grid, t) for t in self.rope_types}
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()[None, None]
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            given = {"position_embeddings": tables.get(self.types[i], tables) if tables else None,
                     "attention_mask": causal if self.reads_mask[i] else None, "position_ids": position_ids,
                     "layer_idx": getattr(layer, "layer_idx", i), "shared_kv_states": {},
                     **dict.fromkeys(("hidden_states", "q", "k", "v"), x)}  # CTRL's names its inputs v, k, q
            engine = ({"kv_shapes": cache} if isinstance(cache, list) else {"seen": cache} if isinstance(cache, dict)
                      else dict(k_cache=cache[0], v_cache=cache[1], slot_mapping=slot_mapping, block_size=self.block_size))
            out = layer(**{k: v for k, v in given.items() if k in self.params[i]}, **engine)
            out = out[0] if isinstance(out, tuple) else out
            x = x + out if out.shape == x.shape else x  # Zamba-2's read [x, embeddings]: each reads the step's
        return x

    def rope(self) -> str:
        """The rotary kind, as the survey's table names it: rope type, partial factor, grids."""
        if self.rotary is None:
            return "none"
        config = self.layers[0].config
        params = getattr(config, "rope_parameters", None) or {}
        params = params.get(self.types[0] or self.rope_types[0], params)
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return params.get("rope_type", "default") + (f" partial {partial:g}" if partial not in (None, 1.0) else "") + (
            f" mrope x{self.grids}" if self.grids else "")


def build_zoo_model(model: ZooModel, *, num_tokens: int = 7, num_layers: int = 2, block_size: int = 16, seed: int = 0,
                    device="cpu"):
    """(module, args) for ``model``, as ``clients.build_client``: ``module(*args)`` runs
    ``num_layers`` of its attention modules (a ``ZooLayers``) on fresh random inputs from
    ``seed`` (bf16 weights, norm weights uniform in 0.5..1.5, slots valid and distinct); ``args``
    are ``(x, positions, slot_mapping, caches)``, the caches ``[(k_cache, v_cache)]`` a layer, each
    ``[num_blocks, block_size, Hkv, D]`` of its own D, filled with -7. The layers run once first to
    learn those shapes (``module.kv_shapes``); whatever fails (config, model, that run) raises."""
    register_zoo_attention()
    module = importlib.import_module(model.module)
    with torch.random.fork_rng(devices=[]):  # the global RNG is left alone
        torch.manual_seed(seed)
        built, layers = _build(module, model, num_layers)
        for layer in layers:
            layer.config._attn_implementation = ZOO_ATTENTION
            for sub in layer.modules():  # HF inits norm weights to ones (Gemma: zeros): make them say something
                if "Norm" in type(sub).__name__ and isinstance(getattr(sub, "weight", None), nn.Parameter):
                    sub.weight.data.uniform_(0.5, 1.5)
        # eval: a model is built training, and some families' dropouts (GPT-BigCode's residual one) default on
        zoo = ZooLayers(layers, _nearest(built, model.rotary, layers[0]), block_size).to(torch.bfloat16).eval()
        # the input width is the first projection's (BLT's that of its part, Zamba-2's twice the hidden size)
        hidden = next(getattr(m, "in_features", None) or m.nx for m in layers[0].modules()
                      if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        x = torch.randn(1, num_tokens, hidden).to(torch.bfloat16)
        num_blocks = -(-(num_tokens + 16) // block_size)
        slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    positions = torch.arange(num_tokens)[None]
    with torch.no_grad():
        zoo(x, positions, slots, [zoo.kv_shapes] * num_layers)  # each layer appends its (Hkv, Dk, Dv)
    zoo = zoo.to(device)
    caches = [tuple(torch.full((num_blocks, block_size, heads, dim), -7.0, dtype=torch.bfloat16, device=device)
                    for dim in (dk, dv)) for heads, dk, dv in zoo.kv_shapes]
    return zoo, (x.to(device), positions.to(device), slots.to(device), caches)


def zoo_cache_rows(caches, slots: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """fp32 rows ``[T, Hkv, D]`` every layer's k and v cache holds at ``slots``."""
    return [c[slots // block_size, slots % block_size].float() for pair in caches for c in pair]
