"""vLLM 0.33.0's own CUDA ops, called the way vLLM calls them: the production column of the
benchmark pages and the other side of the parity tests (bench/README.md, the production column).

The ops come from vLLM's op library, never from the vllm package (the GPU machine has none):
``vllm_ops_sm90.so.xz``, made by the shared tool ``vllm_ops_library.py`` and carried in the
git-ignored ``.vllm/`` of the checkout, or named by ``$PREPFUSE_VLLM_LIB`` (a ``.so`` or a
``.so.xz``; an ``.xz`` is unpacked once, beside itself). ``load()`` gives the ops or None,
``absent_reason()`` says why not: no library, no CUDA, a GPU other than the library's sm_90,
or a load that failed. Why a column of vLLM's ops: a fused op is worth what it saves against
the ops an engine runs today, timed in the same run.

Each callable takes prepfuse-bench-friendly arguments and launches exactly what vLLM launches
(``vllm/models/deepseek_v4/attention.py``'s ``_fused_qnorm_rope_kv_insert``; Qwen3's
attention with and without ``QKNormRoPEFusionPass``; Llama's), so a CUDA graph of it holds
vLLM's kernels and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import lzma
import os
from pathlib import Path

import torch

LIB_ENV = "PREPFUSE_VLLM_LIB"
LIB_DIR = Path(__file__).resolve().parents[1] / ".vllm"
LIB_NAME = "vllm_ops_sm90.so"
VLLM_VERSION = "0.33.0"
LIB_CAPABILITY = (9, 0)  # the tool keeps sm_90 device code only
OPS = {  # namespace -> ops the callables launch
    "_C": ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert",
           "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert", "fused_qk_norm_rope", "rotary_embedding", "rms_norm"),
    "_C_cache_ops": ("reshape_and_cache_flash",),
}
# GQA paths: "fused" is what vLLM runs with its QK-norm + RoPE fusion pass (fused_qk_norm_rope,
# or rotary_embedding alone without a norm), "default" without it (two rms_norm, rotary_embedding)
GQA_PATHS = ("fused", "default")


# --------------------------------------------------------------------------------------
# Finding and loading the library
# --------------------------------------------------------------------------------------
def library_file() -> Path | None:
    """The library file: ``$PREPFUSE_VLLM_LIB``, else ``.vllm/vllm_ops_sm90.so`` or its ``.xz``;
    None where there is none."""
    named = os.environ.get(LIB_ENV)
    candidates = [Path(named)] if named else [LIB_DIR / LIB_NAME, LIB_DIR / f"{LIB_NAME}.xz"]
    return next((path for path in candidates if path.is_file()), None)


def unpacked(path: Path) -> Path:
    """``path`` itself, or an ``.xz`` decompressed beside it (once; renamed into place, so that
    concurrent test workers never load half a file)."""
    if path.suffix != ".xz":
        return path
    so = path.with_suffix("")
    if not so.is_file() or so.stat().st_mtime < path.stat().st_mtime:
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        tmp.write_bytes(lzma.decompress(path.read_bytes()))
        os.replace(tmp, so)
    return so


@functools.lru_cache(maxsize=1)
def _state() -> tuple[VllmOps | None, str]:
    """(the ops, "") or (None, why not); computed once a process."""
    path = library_file()
    if path is None:
        where = os.environ.get(LIB_ENV) or f"{LIB_DIR}/{LIB_NAME}[.xz]"
        return None, f"vLLM's op library is absent ({where}; bench/README.md says how to make it)"
    if not torch.cuda.is_available():
        return None, "vLLM's op library needs a CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability != LIB_CAPABILITY:
        return None, f"vLLM's op library holds sm_90 code only; this GPU is sm_{capability[0]}{capability[1]}"
    try:
        path = unpacked(path)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, lzma.LZMAError) as err:
        return None, f"vLLM's op library did not load ({path}): {type(err).__name__}: {err}"
    missing = [f"{ns}.{op}" for ns, ops in OPS.items() for op in ops if not hasattr(getattr(torch.ops, ns), op)]
    if missing:
        return None, f"vLLM's op library ({path}) lacks {', '.join(missing)}"
    return VllmOps(path), ""


def load() -> VllmOps | None:
    """vLLM's ops, or None where they cannot run here (``absent_reason`` says why)."""
    return _state()[0]


def absent_reason() -> str:
    """Why ``load()`` is None; "" when the ops are loaded."""
    return _state()[1]


# --------------------------------------------------------------------------------------
# The column in a result file and on a page
# --------------------------------------------------------------------------------------
def column_info() -> dict:
    """The result file's record of the column: the library loaded, or why it is absent."""
    ops = load()
    return {"library": str(ops.path), "version": VLLM_VERSION} if ops else {"absent": absent_reason()}


def add_speedup(rows: list[dict], key) -> None:
    """Give each timed ``fused`` row whose shape (``key(row)``) has a timed ``vllm`` row vLLM's
    median (``vllm_us_median``) and ``speedup_vs_vllm``, vLLM's time over the fused op's."""
    vllm = {key(r): r for r in rows if r["impl"] == "vllm" and "us_median" in r}
    for r in rows:
        if r["impl"] == "fused" and "us_median" in r and key(r) in vllm:
            r["vllm_us_median"] = vllm[key(r)]["us_median"]
            r["speedup_vs_vllm"] = r["vllm_us_median"] / r["us_median"]


def has_column(data: dict) -> bool:
    """Whether a result file holds vLLM rows (pages of older runs keep their columns)."""
    return any(r["impl"].startswith("vllm") for r in data.get("rows", []))


def page_note(data: dict, what: str = "own CUDA ops from its op library", where: str = "bench/vllm_ops.py") -> list[str]:
    """A page's line on the column: which of vLLM's kernels it times (``what``, loaded by
    ``where``), or why a run has none (nothing for result files from before the column)."""
    info = data.get("vllm")
    if info is None:
        return []
    if "absent" in info:
        return [f"- **vLLM column:** absent from this run: {info['absent']}"]
    return [f"- **vLLM column:** vLLM {info['version']}'s {what}, timed in this run by the "
            f"same method (`{where}`); `x vLLM` is vLLM's time over the fused op's."]


# --------------------------------------------------------------------------------------
# GQA operands in vLLM's form
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class GqaCall:
    """One GQA call's operands as vLLM holds them (``gqa_call`` makes them from prepfuse's)."""

    qkv: torch.Tensor  # [T, (Hq + 2*Hkv) * D] bf16, contiguous: the qkv projection's output
    q_weight: torch.Tensor | None  # [D] bf16 (Qwen3), None without the q/k norm (Llama)
    k_weight: torch.Tensor | None
    k_cache: torch.Tensor  # [NB, BS, Hkv, D] bf16, or uint8 e4m3fn codes (vLLM's "fp8" cache)
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T'] int64, negative skips
    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [P, R] bf16: R/2 cos then R/2 sin (RotaryEmbedding keeps the model dtype)
    k_scale: torch.Tensor  # [1] fp32: cache code = e4m3(x / k_scale); 1.0 for a bf16 cache
    v_scale: torch.Tensor
    kv_cache_dtype: str  # "auto" (bf16 cache) or "fp8"
    num_q_heads: int
    num_kv_heads: int
    is_neox: bool
    eps: float

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]


def gqa_call(inputs) -> GqaCall:
    """vLLM's operands for the call ``inputs`` (prepfuse.testing.GqaInputs, paged caches, the
    [P, R] half table, positions given) describes: the same caches (a uint8 view where they
    hold fp8 codes), a contiguous copy of qkv (vLLM's ops rewrite it in place; its projection
    writes it dense), the table rounded to bf16, kv_scale as k_scale, v_scale or kv_scale as
    v_scale. Compare its writes with prepfuse's on ``with_bf16_table(inputs)``."""
    fp8 = inputs.kv_scale is not None
    one = torch.ones(1, dtype=torch.float32, device=inputs.qkv.device)
    return GqaCall(
        qkv=inputs.qkv.clone(memory_format=torch.contiguous_format),
        q_weight=inputs.q_norm_weight,
        k_weight=inputs.k_norm_weight,
        k_cache=inputs.k_cache.view(torch.uint8) if fp8 else inputs.k_cache,
        v_cache=inputs.v_cache.view(torch.uint8) if fp8 else inputs.v_cache,
        slot_mapping=inputs.slot_mapping.long(),
        positions=inputs.positions.long(),
        cos_sin_cache=inputs.cos_sin_cache.to(torch.bfloat16),
        k_scale=inputs.kv_scale if fp8 else one,
        v_scale=(inputs.v_scale if inputs.v_scale is not None else inputs.kv_scale) if fp8 else one,
        kv_cache_dtype="fp8" if fp8 else "auto",
        num_q_heads=inputs.num_q_heads,
        num_kv_heads=inputs.num_kv_heads,
        is_neox=inputs.is_neox,
        eps=inputs.eps,
    )


def with_bf16_table(inputs):
    """``inputs`` with its fp32 cos/sin table rounded to bf16 values (still fp32): the table
    vLLM's GQA paths read, so prepfuse's op and vLLM's see the same angles."""
    return dataclasses.replace(inputs, cos_sin_cache=inputs.cos_sin_cache.to(torch.bfloat16).float())


def gqa_agreement(ref, got) -> dict:
    """How one GQA call's writes in ``got`` (vLLM's, its q copied into ``q_out``) stand against
    ``ref``'s (prepfuse's op or its reference; both prepfuse.testing.GqaInputs of the same
    call, fresh poisoned outputs). Their norms and RoPE round differently (vLLM's fused
    kernel rounds once after an fp32 norm; its default path rounds as Qwen3RMSNorm does and
    rotates in bf16), so q and k agree within ``2^-6 (|a| + |b|)`` (``a`` the normed value,
    ``b`` its RoPE partner: prepfuse.testing.normed_pair_sum), with an fp8 cache plus one e4m3
    step of the value: ``q_ratio`` and ``k_ratio`` are the largest difference over that bound.
    v's cache bytes and every byte of the slots not written must be equal. ``within``: all hold."""
    from prepfuse.testing import normed_pair_sum

    q_ratio = _ratio(got.q_out.float() - ref.q_out.float(), 2**-6 * normed_pair_sum(ref, "q"))
    tokens = torch.nonzero(ref.slot_mapping >= 0).flatten()
    slots = ref.slot_mapping[tokens]
    written = torch.zeros(ref.k_cache.shape[:2], dtype=torch.bool, device=slots.device)
    block_size = ref.k_cache.shape[1]
    written[slots // block_size, slots % block_size] = True
    k_ref, k_got = (_dequantized(c, ref.kv_scale)[written] for c in (ref.k_cache, got.k_cache))
    # the caches' rows in slot order are the tokens' rows: written[...] reads them in block order
    order = torch.argsort(slots)
    bound = 2**-6 * normed_pair_sum(ref, "k")[tokens[order]]
    if ref.kv_scale is not None:  # one e4m3 step (3 mantissa bits) of the larger value, or a subnormal step
        bound = bound + torch.maximum(2**-3 * torch.maximum(k_ref.abs(), k_got.abs()), 2**-9 * ref.kv_scale)
    k_ratio = _ratio(k_got - k_ref, bound)
    v_equal = torch.equal(_bits(ref.v_cache), _bits(got.v_cache))
    others_equal = torch.equal(_bits(ref.k_cache)[~written], _bits(got.k_cache)[~written])
    return {"q_ratio": q_ratio, "k_ratio": k_ratio, "v_equal": v_equal, "others_equal": others_equal,
            "within": q_ratio <= 1 and k_ratio <= 1 and v_equal and others_equal}


def _ratio(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest ``|diff| / bound`` (a zero bound asks for equality); NaN counts as infinite."""
    ratio = diff.abs() / bound.clamp_min(2**-30)
    return float(torch.nan_to_num(ratio, nan=float("inf")).max()) if ratio.numel() else 0.0


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """A cache's elements as integers of their width (bf16 -> int16, fp8 codes -> uint8)."""
    return cache.view(torch.int16 if cache.element_size() == 2 else torch.uint8)


def _dequantized(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache's values in fp32: bf16 as is, e4m3fn codes (float8 or uint8) times ``scale``."""
    if scale is None:
        return cache.float()
    return cache.view(torch.float8_e4m3fn).float() * scale


def dsv4_fits(num_tokens: int, padded_heads: int) -> bool:
    """Whether vLLM's DeepSeek-V4 op can take the shape: its q tensors must stay under 2^31
    bytes (vLLM 0.33 faults with an illegal memory access at H=128, T=16384 on an H100: q of
    2^31 bytes), and a fault would end every later CUDA call of the process."""
    return num_tokens * padded_heads * 512 * 2 < 2**31


# --------------------------------------------------------------------------------------
# The production paths
# --------------------------------------------------------------------------------------
class VllmOps:
    """vLLM's ops, loaded; each method launches what vLLM launches for that path."""

    def __init__(self, path: Path):
        self.path = path

    @staticmethod
    def dsv4_fp8_ds_mla_insert(inputs, padded_heads: int | None = None) -> torch.Tensor:
        """DeepSeek-V4's prep into an fp8_ds_mla cache (a uint8 sliding-window cache), for
        prepfuse.testing.Dsv4Inputs: writes ``inputs.k_cache`` ([NB, stride] uint8, vLLM's 2-d
        view of its cache), returns the padded q [T, HP, 512] bf16 the op allocates (HP:
        ``padded_heads``, default ``inputs.q_out``'s head count). ``inputs.apply_q_norm`` and
        ``inputs.kv_mxfp8`` go to vLLM's flags of those names (DeepSeek-V4.1 passes False and,
        on SM100, True); its apply_q_rope=True and is_q_interleaved=False stay."""
        hp = inputs.q_out.shape[1] if padded_heads is None else padded_heads
        return torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            inputs.q, inputs.kv, inputs.k_cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache,
            hp, inputs.eps, inputs.block_size, inputs.apply_q_norm, inputs.kv_mxfp8)

    @staticmethod
    def dsv4_full_row_insert(inputs) -> torch.Tensor:
        """DeepSeek-V4's prep into a full-row cache, for prepfuse.testing.Dsv4FullRowInputs of
        unpadded q (vLLM's call; FlashInfer's padding is a later copy): bf16 rewrites ``inputs.q``
        in place and returns it, per-tensor fp8 writes ``inputs.q_out`` (e4m3) and returns it.
        ``inputs.kv_scale`` is vLLM's ``fp8_scale`` (rows times its reciprocal), ``q_scale_inv``
        its ``q_scale_inv``; ``inputs.k_cache`` is [NB, block_size, 512]."""
        if inputs.k_cache.dtype == torch.bfloat16:
            torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert(
                inputs.q, inputs.kv, inputs.k_cache, inputs.slot_mapping, inputs.positions, inputs.cos_sin_cache,
                inputs.eps, inputs.block_size, inputs.apply_q_norm)
            return inputs.q
        torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert(
            inputs.q, inputs.kv, inputs.q_out, inputs.k_cache, inputs.slot_mapping, inputs.positions,
            inputs.cos_sin_cache, inputs.kv_scale, inputs.q_scale_inv, inputs.eps, inputs.block_size,
            inputs.apply_q_norm)
        return inputs.q_out

    def dsv4_outputs(self, inputs):
        """vLLM's DeepSeek-V4 op for the cache ``inputs`` holds (fp8_ds_mla: a 2-d uint8 cache;
        else full rows) run on fresh outputs of ``inputs``, its q in their ``q_out``, to compare
        with prepfuse's: where vLLM returns q (fp8_ds_mla's padded q; the bf16 full-row op
        rewrites q in place, so on a copy of q) it is copied there."""
        got = inputs.fresh_outputs()
        if got.k_cache.dim() == 2:
            got.q_out.copy_(self.dsv4_fp8_ds_mla_insert(got))
        elif got.k_cache.dtype == torch.bfloat16:
            got = dataclasses.replace(got, q=got.q.clone())
            got.q_out.copy_(self.dsv4_full_row_insert(got))
        else:
            self.dsv4_full_row_insert(got)
        return got

    def gqa(self, call: GqaCall, path: str = "fused") -> torch.Tensor:
        """Qwen3 / Llama attention-input prep as vLLM runs it (``GQA_PATHS``): q and k
        normed (with weights) and roped, k and v written into the paged caches at the
        slots. Returns q [T, Hq, D] bf16, a view of ``call.qkv`` (rewritten in place), or
        of the buffer the default path's rms_norm writes."""
        q, k, v = self._split(call.qkv, call)
        if call.q_weight is not None and path == "fused":
            torch.ops._C.fused_qk_norm_rope(
                call.qkv, call.num_q_heads, call.num_kv_heads, call.num_kv_heads, call.head_dim, call.eps,
                call.q_weight, call.k_weight, call.cos_sin_cache, call.is_neox, call.positions)
        else:
            if call.q_weight is not None:
                q, k = self._rms_norm(q, call.q_weight, call.eps), self._rms_norm(k, call.k_weight, call.eps)
            torch.ops._C.rotary_embedding(call.positions, q, k, call.head_dim, call.cos_sin_cache, call.is_neox)
        self._insert(k, v, call)
        return q.unflatten(1, (call.num_q_heads, call.head_dim))

    @staticmethod
    def _split(qkv: torch.Tensor, call: GqaCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: column views of qkv, [T, H*D] each (vLLM's ``qkv.split``)."""
        d = call.head_dim
        return qkv.split([call.num_q_heads * d, call.num_kv_heads * d, call.num_kv_heads * d], dim=-1)

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """vLLM's RMSNorm on CUDA (``vllm/kernels/vllm_c.py``): the [T, H, D] view of the
        column slice in, a new dense output; returned flat [T, H*D] as Qwen3 views it back."""
        heads = x.unflatten(1, (-1, weight.shape[0]))
        out = torch.empty(heads.shape, dtype=x.dtype, device=x.device)
        torch.ops._C.rms_norm(out, heads, weight, eps)
        return out.flatten(1)

    @staticmethod
    def _insert(k: torch.Tensor, v: torch.Tensor, call: GqaCall) -> None:
        """``reshape_and_cache_flash`` as vLLM's attention layer calls it: k and v as [T, Hkv, D]
        views, caches [NB, BS, Hkv, D], its own k and v scales."""
        heads = (call.num_kv_heads, call.head_dim)
        torch.ops._C_cache_ops.reshape_and_cache_flash(
            k.unflatten(1, heads), v.unflatten(1, heads), call.k_cache, call.v_cache, call.slot_mapping,
            call.kv_cache_dtype, call.k_scale, call.v_scale)
