"""prepfuse's passes inside vLLM 0.33's own post-grad pass manager, with the real vLLM.

The pass is handed in as vLLM takes one (``CompilationConfig.inductor_compile_config``),
vLLM's ``VllmBackend.configure_post_pass`` adds it to vLLM's ``PostGradPassManager``, and
Inductor compiles a plain-PyTorch Qwen3-style prep (q/k RMSNorm, NeoX RoPE, paged k/v cache
writes) with vLLM's config patches, under vLLM's pass context (``compile_context``), on the
CPU platform (``VLLM_TARGET_DEVICE=cpu``: there is no GPU, and vLLM's config needs a
platform). The same graph holds a second attention's q and k rotated by vLLM's own
``_C.rotary_embedding`` op, so that vLLM's ``fix_functionalization`` has its op to rewrite
while prepfuse's ``defunctionalize`` rewrites prepfuse's; given ``_C``, prepfuse's pass
rewrites vLLM's call first, or declines it (q and k split from one projection, under the
``auto_functionalized`` v1 vLLM sets) and leaves it to vLLM's. k and v caches of one buffer
are the v1 case prepfuse declines for its own op.

What cannot run on a CPU-only machine, and stands in here:

- vLLM's kernel library (``vllm._C_stable_libtorch`` in the CUDA wheel) loads only with the
  CUDA driver (``libcuda.so.1``), so ``torch.ops._C`` is empty. ``FixFunctionalizationPass``
  names ``torch.ops._C.rotary_embedding`` on every call, so this module defines that one op
  when it is missing: the schema vLLM's library registers (the string its binary holds) and
  vLLM's own PyTorch RoPE (``RotaryEmbedding.forward_static``) as its CPU kernel. Every
  pass, config and the manager are vLLM's, unchanged. For an ``auto_functionalized`` call
  of any other op the pass names more ``_C`` ops (``fused_add_rms_norm``, ...), so a graph
  that reaches it with a prepfuse call still functional cannot run here: the shared-buffer
  test is strict, and stops in prepfuse's pass.
- vLLM's own fusion passes (RMSNorm/quant, QK-norm-RoPE, RoPE-KV-cache, all-reduce) are
  constructed only on CUDA, ROCm or XPU platforms (they match ``_C`` ops); on the CPU
  platform the manager holds ``NoOpEliminationPass`` and prepfuse's pass. prepfuse running
  after them is not exercised.
- prepfuse's fused op runs its CPU reference, not its Triton kernel; no vLLM model, model
  runner or attention backend runs (in vLLM the cache write is inside the attention op).

The main suite (torch 2.13, no vLLM) skips all but the import test; ``scripts/test_vllm.sh``
runs them in a venv with vLLM.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_inductor_cache, run_and_get_code
from torch.testing import FileCheck

from prepfuse.fx_passes.fusion.gqa import FuseGqaPrepPass
from prepfuse.fx_passes.mutation_info import functionalized_op
from prepfuse.models.gqa import GqaSpelling, gqa_prep, make_norms
from prepfuse.ops import DSV4_QNORM_ROPE_KV_INSERT, GQA_QKNORM_ROPE_KV_INSERT
from prepfuse.testing import make_dsv4_inputs

# before vLLM picks its platform (on first use): the CPU one, there is no GPU here
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.compilation.backends import VllmBackend
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.utils import Range
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from prepfuse.integrations.vllm import BY_LAYER_NAMESPACE, PrepfuseVllmPass
except ImportError:
    VllmBackend = None

needs_vllm = pytest.mark.skipif(VllmBackend is None, reason="vLLM is not installed (scripts/test_vllm.sh runs these)")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

T, HQ, HKV, D, BLOCKS, BLOCK, EPS = 7, 4, 2, 64, 4, 16, 1e-6
# vLLM 0.33's schema of the op (its _C_stable_libtorch registers this string)
ROTARY_EMBEDDING = ("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
                    "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()")


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    if rope_dim_offset or inverse:
        raise NotImplementedError("the stand-in rotates the leading dims forwards only")
    rotary_dim = cos_sin_cache.shape[-1]
    q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, rotary_dim, cos_sin_cache, is_neox)
    query.copy_(q)
    if key is not None:
        key.copy_(k)


if VllmBackend is not None and not hasattr(torch.ops._C, "rotary_embedding"):
    _C_STAND_IN = torch.library.Library("_C", "FRAGMENT")  # lives as long as the test module
    _C_STAND_IN.define(ROTARY_EMBEDDING)
    _C_STAND_IN.impl("rotary_embedding", _rotary_embedding, "CPU")
    torch.library.register_fake("_C::rotary_embedding", lambda *args, **kwargs: None, lib=_C_STAND_IN)


# Qwen3's q/k norm (Hugging Face's RMSNorm) and vLLM's ``forward_native`` RoPE (fp32, halves)
SPELLING = GqaSpelling("qwen3-vllm-native-rope", rope="halves")
Q_NORM, K_NORM = make_norms(D, EPS, SPELLING, torch.Generator().manual_seed(0))


def attention_prep(qkv, table, positions, slots, k_cache, v_cache):
    """One attention's prep in plain PyTorch (``prepfuse.models.gqa``), k and v written into
    paged caches: q."""
    return gqa_prep(qkv, Q_NORM, K_NORM, k_cache, v_cache, slots, positions, table, None, HQ, HKV, SPELLING)


def layer(qkv, table, positions, slots, k_cache, v_cache, q2, k2):
    """The prep, and a second attention's q and k rotated in place by vLLM's op, as vLLM's
    ``RotaryEmbedding.forward_cuda`` calls it."""
    q = attention_prep(qkv, table, positions, slots, k_cache, v_cache)
    torch.ops._C.rotary_embedding(positions, q2, k2, D, table, True)
    return q


def layer_qk_of_one_projection(qkv, table, positions, slots, k_cache, v_cache, qk2):
    """As ``layer``, the second q and k split from one projection, as vLLM's models have them."""
    q = attention_prep(qkv, table, positions, slots, k_cache, v_cache)
    q2, k2 = qk2.split([HQ * D, HKV * D], -1)
    torch.ops._C.rotary_embedding(positions, q2, k2, D, table, True)
    return q


def layer_kv_of_one_buffer(qkv, table, positions, slots, kv_cache):
    """The prep into vLLM's FlashAttention layout: k and v caches of one ``[2, blocks, ...]`` buffer."""
    k_cache, v_cache = kv_cache.unbind(0)
    return attention_prep(qkv, table, positions, slots, k_cache, v_cache)


def inputs_of(fn, seed: int):
    """Fresh inputs of one of the layers, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    qkv = bf16(T, (HQ + 2 * HKV) * D)
    table = 2 * torch.rand(64, D, generator=gen) - 1
    positions = torch.randperm(60, generator=gen)[:T]
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:T]
    kv_cache = bf16(2, BLOCKS, BLOCK, HKV, D)
    q2, k2 = bf16(T, HQ * D), bf16(T, HKV * D)
    return [qkv, table, positions, slots, *{
        layer: (kv_cache[0].clone(), kv_cache[1].clone(), q2, k2),
        layer_qk_of_one_projection: (kv_cache[0].clone(), kv_cache[1].clone(), torch.cat((q2, k2), -1)),
        layer_kv_of_one_buffer: (kv_cache,),
    }[fn]]


class Watch:
    """Stands in for the manager's ``fix_functionalization`` and calls it: which ops are
    still ``auto_functionalized`` when it starts and when it is done, and the final graph's
    call targets (nothing runs after it in vLLM's manager)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before = functional_ops(graph)
        self.inner(graph)
        self.after = functional_ops(graph)
        self.targets = [n.target for n in graph.nodes if n.op == "call_function"]

    def uuid(self):
        return self.inner.uuid()


def functional_ops(graph: torch.fx.Graph) -> list[str]:
    return [str(functionalized_op(n)) for n in graph.nodes if functionalized_op(n) is not None]


def vllm_backend(prepfuse_pass) -> VllmBackend:
    """What vLLM builds from the documented hand-in (docs/kit.md): its config, and its
    backend with the post-grad pass manager configured (``configure_post_pass``)."""
    config = VllmConfig(compilation_config=CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": prepfuse_pass}))
    backend = VllmBackend(config)
    backend.configure_post_pass()
    return backend


def compile_with(backend, fn, args, **config):
    """``fn(*args)`` compiled by Inductor with vLLM's config patches, inside vLLM's pass
    context for one compile size: (output, generated code)."""
    options = {**backend.inductor_config, **config}
    with backend.compiler_manager.compile_context(Range(start=T, end=T)):
        compiled = torch.compile(fn, backend="inductor", fullgraph=True, options=options)
        out, (code,) = run_and_get_code(compiled, *args)
    return out, code


# (prepfuse's namespaces, the model, whether prepfuse's defunctionalize rewrites vLLM's call)
CASES = {
    "prepfuse": (("prepfuse",), layer, False),
    "prepfuse+_C": (("prepfuse", "_C"), layer, True),
    # v1 clones each written argument, and q and k share a storage: prepfuse declines, vLLM rewrites
    "prepfuse+_C-qk-of-one-projection": (("prepfuse", "_C"), layer_qk_of_one_projection, False),
}


@needs_vllm
@pytest.mark.parametrize("case", list(CASES))
def test_prepfuse_fuses_inside_vllms_pass_manager(case):
    namespaces, fn, prepfuse_takes_vllms = CASES[case]
    strict = fn is not layer_qk_of_one_projection  # strict covers _C: the declined call would fail it
    prepfuse_pass = PrepfuseVllmPass({"strict": strict, "namespaces": namespaces})
    backend = vllm_backend(prepfuse_pass)
    manager = backend.pass_manager
    # the CPU platform's passes, then ours: VllmBackend's deep copy of the config kept this very object
    assert [type(p).__name__ for p in manager.passes] == ["NoOpEliminationPass", "PrepfuseVllmPass"]
    assert manager.passes[-1] is prepfuse_pass
    watch = manager.fix_functionalization = Watch(manager.fix_functionalization)
    args, eager_args = inputs_of(fn, 3), inputs_of(fn, 3)
    out, code = compile_with(backend, fn, args, fx_graph_cache=False)

    torch.testing.assert_close(out, fn(*eager_args), rtol=0, atol=0)  # the op's math is the model's, in fp32
    for got, want in zip(args, eager_args):  # every cache byte, and vLLM's q and k rotated in place
        assert torch.equal(got, want)
    (report,) = prepfuse_pass.reports
    rope = "_C.rotary_embedding.default"
    assert report.pattern_counts() == {
        "gqa_qknorm_rope_kv": 1, f"{GQA_QKNORM_ROPE_KV_INSERT}/v1": 1,  # vLLM sets auto_functionalized v1
        **({f"{rope}/v1": 1} if prepfuse_takes_vllms else {}),
    }
    assert report.namespaces == (*namespaces, BY_LAYER_NAMESPACE)  # the by-layer op on vLLM's key: prepfuse's
    declined = [(r.pattern, r.why) for r in report.near_misses("defunctionalize")]
    if fn is layer_qk_of_one_projection:
        assert declined == [(f"{rope}/v1", "key: shares storage with another written argument (v1 clones each)")]
        assert report.functionalized_left == [f"auto_functionalized ({rope})"]
    else:
        assert declined == [] and report.functionalized_left == []
    # each op is defunctionalized once: prepfuse's by prepfuse, vLLM's by vLLM unless prepfuse took it
    assert watch.before == ([] if prepfuse_takes_vllms else [rope]) and watch.after == []
    assert GQA_QKNORM_ROPE_KV_INSERT in watch.targets and torch.ops._C.rotary_embedding.default in watch.targets
    FileCheck().check_not("auto_functionalized").check_not("clone").run(code)
    FileCheck().check_count(f"torch.ops.{GQA_QKNORM_ROPE_KV_INSERT}(", 1, exactly=True).run(code)
    FileCheck().check_count(f"torch.ops.{rope}(", 1, exactly=True).run(code)


@needs_vllm
def test_k_and_v_caches_of_one_buffer_stay_functional_under_vllms_v1():
    """vLLM compiles with auto_functionalized v1, which clones each written argument: the
    fused call writing k and v parts of one buffer is declined by defunctionalize, which a
    strict compile refuses (docs/kit.md)."""
    prepfuse_pass = PrepfuseVllmPass({"strict": True})
    with pytest.raises(Exception, match=r"(?s)PrepfuseStrictError.*v_cache: shares storage with another written "
                                        r"argument \(v1 clones each\)"):
        compile_with(vllm_backend(prepfuse_pass), layer_kv_of_one_buffer, inputs_of(layer_kv_of_one_buffer, 3),
                     fx_graph_cache=False)
    (report,) = prepfuse_pass.reports
    assert report.count("gqa_qknorm_rope_kv") == 1 and report.matched_counts["defunctionalize"] == 0


@needs_vllm
def test_vllms_uuids_follow_prepfuses_options_and_sources(monkeypatch):
    def uuids(options):
        prepfuse_pass = PrepfuseVllmPass(options)
        backend = vllm_backend(prepfuse_pass)
        with backend.compiler_manager.compile_context(Range(start=T, end=T)):
            # the manager's keys Inductor's cache; the config's names vLLM's own compile cache
            return prepfuse_pass.uuid(), backend.pass_manager.uuid(), backend.vllm_config.compute_hash()

    base = uuids({})
    assert uuids({}) == base
    changed = uuids({"validate": "quick"})
    assert all(a != b for a, b in zip(base, changed))
    monkeypatch.setattr(FuseGqaPrepPass, "uuid_sources", (*FuseGqaPrepPass.uuid_sources, attention_prep))
    edited = uuids({})  # as if the GQA pass's sources had changed
    assert all(a != b for a, b in zip(base, edited))


@needs_vllm
def test_the_pass_crosses_processes_as_its_options():
    prepfuse_pass = PrepfuseVllmPass({"validate": "quick"})
    prepfuse_pass.manager.reports.append("a report of this process")
    config = VllmConfig(compilation_config=CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": prepfuse_pass}))
    copied = pickle.loads(pickle.dumps(config)).compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    assert type(copied) is PrepfuseVllmPass and copied is not prepfuse_pass
    assert copied.options == prepfuse_pass.options and copied.uuid() == prepfuse_pass.uuid()
    assert len(copied.reports) == 0


def direct_call(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache):
    """A graph with one prepfuse op call and nothing for Inductor to build: cheap to compile."""
    DSV4_QNORM_ROPE_KV_INSERT(q, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, 1e-6, 16)


@needs_vllm
def test_inductors_fx_graph_cache_keys_on_prepfuses_pass():
    def compile_once(options):
        torch._dynamo.reset()
        prepfuse_pass = PrepfuseVllmPass(options)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        # vLLM's Inductor adaptors turn the FX graph cache on
        compile_with(vllm_backend(prepfuse_pass), direct_call, make_dsv4_inputs(7, 3, 8, 16, "cpu").args()[:7],
                     fx_graph_cache=True)
        return len(prepfuse_pass.reports), counters["inductor"]["fxgraph_cache_hit"] - hits

    with fresh_inductor_cache():
        assert compile_once({"strict": True}) == (1, 0)  # the passes ran
        assert compile_once({"strict": True}) == (0, 1)  # served from the cache: no pass ran
        assert compile_once({"strict": True, "validate": "quick"}) == (1, 0)  # other options: a miss
        assert compile_once({"strict": True, "validate": "quick"}) == (0, 1)


@needs_vllm
@pytest.mark.parametrize("options, why", [
    ({"inductor_config": {"max_autotune": True}}, "put Inductor settings in CompilationConfig.inductor_compile_config"),
    ({"auto_functionalized_v2": True}, "vLLM sets enable_auto_functionalized_v2"),
    ({"splitting_ops": ["aten::mm"]}, "vLLM splits the graph at CompilationConfig.splitting_ops"),
    ({"cudagraphs": "full"}, "vLLM captures CUDA graphs itself"),
])
def test_options_vllm_sets_itself_are_refused(options, why):
    with pytest.raises(ValueError, match=f"^{next(iter(options))}: not a prepfuse option inside vLLM: {why}"):
        PrepfuseVllmPass(options)


def test_without_vllm_the_import_says_to_install_it():
    script = "import sys\nsys.modules['vllm'] = None\nimport prepfuse.integrations.vllm\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 1
    assert "ImportError: prepfuse.integrations.vllm needs vLLM (pip install vllm)" in done.stderr
