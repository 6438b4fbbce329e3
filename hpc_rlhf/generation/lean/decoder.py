"""A lean forward pass for llama-family decoders (llama, qwen2, mistral) during generation.

Generating from a small model is bound by the number of tensor operations per forward call (module
wrappers, mask building, cache objects, many small element-wise ops), not by arithmetic.  This
decoder runs the same math as the transformers forward with a fraction of the operations: it keeps a
preallocated key/value cache, looks rotary angles up in a table built once per batch, applies the
rotation to queries and keys in one pass, and uses the fused RMS norm in float32.

Its matrix products use packed copies of the module's weights: query, key and value in one matrix,
gate and up in one.  That is fewer, larger products.  On an x86 CPU with AVX2 in float32 the compiled kernels of
``few_rows`` take every product: at most ``few_rows.MAX_ROWS`` rows (small batches, a batch's last rows) read the
module's own weights (``linear_rows``), more rows read a copy packed in panels of 24 outputs (``linear_panels``),
with the RMS norm before a product, the MLP's gating and the residual connections done on the way.  There each
decode step's rotary embedding and cache write (``rope_store``) and its attention (``attend_one``) go to the same
kernels, whatever the row count.  Elsewhere in float32 on the CPU each copy is reordered once into oneDNN's blocked
layout and multiplied by oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``): BLAS packs the weight again at
every call, which at decode's few rows costs more than the arithmetic; and anywhere else each product is
``weight @ x^T`` with the weight [out, in] on the left, so that BLAS streams the weight as the long operand.
A copy costs one more copy of its weights; it is made on the first product that needs it and made again after a
weight of the module changed (its storage or version counter), so loading new weights into the module takes
effect at the next ``start``, and a generation whose products all went to ``linear_rows`` copies nothing.
Tests compare its logits with the transformers forward.

Grouped-query attention (fewer key/value heads than query heads) folds each key/value head's query heads
into its query rows (``grouped_attention``): equal head counts, without copying the cache.  On CUDA no fused
kernel takes a mask with ``enable_gqa`` (flash takes no mask, memory-efficient wants equal heads), so
PyTorch would fall back to its unfused math path; on the CPU the folded call is also faster at decode
(one run each: docs/runs/perf/profile_generation_gqa_before.json, _after.json).

Several samples of one prompt share the prompt's cached keys and values.  On the CPU, ``select_rows`` that
repeats rows keeps the cache written so far once per distinct row (the shared prefix) and gives each sample a
cache of its own for the positions after it.  Attention (``split_attention``) then takes the scores of every
query of a prompt's samples against the prompt's prefix, read once per prompt, and of each row's queries against
its own positions, under one softmax.  A decode step reads the cache more than it computes on it, and at GRPO's
8 samples of a 78-token prompt the prefix is most of what is read (one run each:
docs/runs/perf/profile_generation_zen4_before_shared_prefix.json, _shared_prefix.json).  Where the
prefix is short or the samples few, ``split_attention``'s extra operations cost more than they save, and the
samples copy it (``prefix_pays``), as they always do on CUDA and in bf16.

On CUDA a decode step launches several hundred small kernels, and launching them from Python takes far longer than
running them (SmolLM2-135M at batch 64 on an H200, one run each:
docs/runs/perf/grpo_real_cuda_h200_bf16_eager.json, _graphs.json).  With ``cuda_graphs`` on, ``decode``
captures the step once per batch as a CUDA graph and replays it: the step writes its keys and values at a cache
slot held in a device tensor and attends over the whole cache (the slots not yet written are masked out), so
that its shapes and addresses are the same at every step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..specs import LEAN
from . import few_rows

STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # angles depend on the position only


def _rope_type(cfg) -> str:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, name, None)
        if isinstance(params, dict):
            return params.get("rope_type", params.get("type", "default"))
    return "default"


def lean_supported(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None or not LEAN.runs(getattr(cfg, "model_type", None)):
        return False
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) and window is not None and window < cfg.max_position_embeddings:
        return False
    layer = model.model.layers[0]
    return (getattr(cfg, "hidden_act", "silu") == "silu" and getattr(cfg, "pretraining_tp", 1) == 1
            and _rope_type(cfg) in STATIC_ROPE
            and hasattr(layer.mlp, "gate_proj") and hasattr(layer.self_attn, "q_proj"))


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """The Llama RMS norm: normalise in float32, cast back, then scale (``F.rms_norm`` computes a bf16 or fp16
    input in float32 and rounds once: two operations where the spelled-out norm takes nine)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.variance_epsilon)


# A shared prefix pays once the keys and values it saves reading are many: (rows - distinct rows) × prefix length ×
# key/value heads × head size of them per layer and decode step.  Below that, split_attention's extra operations
# per layer cost more than the copies' attention reads (a 4-layer toy, fp32, 2 threads: 8 rows of one prompt
# gained nothing and lost up to 22% up to a 96-token prompt, 172k; 64 rows of 8 prompts lost 2% at 16 tokens,
# 229k, and gained 10% at 32, 459k; single runs, not stored)
SHARED_PREFIX_MIN_ELEMENTS = 2 ** 18


def prefix_pays(rows: list[int], length: int, kv_heads: int, head_dim: int,
                min_elements: int = SHARED_PREFIX_MIN_ELEMENTS) -> bool:
    """Whether rows ``rows`` (row b a copy of row ``rows[b]``) should share their ``length`` cached positions rather
    than copy them: the key elements that sharing saves reading per layer and step reach ``min_elements`` (pure)."""
    repeats = len(rows) - len(set(rows))
    return repeats > 0 and length > 0 and repeats * length * kv_heads * head_dim >= min_elements


# oneDNN picks its weight layout for a number of rows; the layout chosen for 64 ran as fast at 1 to 64 rows
# and at a prefill's 1088 as the one chosen for each (one run: docs/runs/perf/model_shapes_zen4_onednn.json)
ONEDNN_ROWS_HINT = 64


def onednn_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the decoder multiplies by oneDNN-reordered weights: on the CPU, in float32, where PyTorch has
    oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Packed:
    """A product's weights: the modules' own weights (``parts``, [out_i, in] each, not copies), which the few-row
    kernel reads; their biases stacked (``bias``, None if none has one); and, built on the first product that
    needs it, their weights stacked (``weight``, [sum of outs, in], in oneDNN's layout where ``onednn_products``)."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.parts = [m.weight for m in linears]
        self.out = sum(m.out_features for m in linears)
        self.bias = (None if all(m.bias is None for m in linears) else
                     torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]))
        self._weight: torch.Tensor | None = None
        self._panels: torch.Tensor | None = None

    def panels(self, few) -> torch.Tensor:
        """The weights stacked in the kernel ``few``'s panels (``few_rows``' ``pack_panels``), made on first use."""
        if self._panels is None:
            self._panels = few.pack_panels(self.parts)
        return self._panels

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            with torch.no_grad():
                weight = torch.cat(self.parts)
                if onednn_products(weight.dtype, weight.device):
                    weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
            self._weight = weight
        return self._weight


def _per_query_head(mask: torch.Tensor, g: int) -> torch.Tensor:
    """A mask [B, 1, T or 1, S] for query rows folded g query heads per key/value head: each of the g heads has the
    same T rows, [B, 1, g * T, S] (a one-row mask broadcasts as it is)."""
    if mask.shape[-2] == 1:
        return mask
    B, _, T, S = mask.shape
    return mask[:, :, None].expand(B, 1, g, T, S).reshape(B, 1, g * T, S)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as an additive one: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of ``q`` [B, nq, T, D] over ``k``, ``v`` [B, nkv, S, D] (nq a multiple of nkv; query head h
    reads key/value head h // (nq / nkv), as ``enable_gqa``) with a boolean ``mask`` [B, 1, T or 1, S], as nkv
    heads of (nq / nkv) × T query rows each: the same result with equal head counts."""
    B, nq, T, D = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    o = F.scaled_dot_product_attention(q.reshape(B, nkv, g * T, D), k, v, attn_mask=_per_query_head(mask, g),
                                       scale=scale)
    return o.reshape(B, nq, T, D)


def split_attention(q: torch.Tensor, prefix: "SharedPrefix", layer: int, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q`` [B, nq, T, D] over row b's prefix (``prefix.keys[layer]`` row ``prefix.rows[b]``, its
    padding masked) followed by the row's own ``k``, ``v`` [B, nkv, S, D] with the additive ``mask``
    [B, 1, T or 1, S]: the same as attending over the two concatenated (query head h reads key/value head
    h // (nq / nkv)).  The products with the prefix stack the queries of each prefix's rows, so its keys and
    values are read once per prefix; one softmax runs over each query's prefix and own scores together."""
    B, nq, T, D = q.shape
    nkv = k.shape[1]
    L = (nq // nkv) * T  # query rows per key/value head
    rows = (q * scale).reshape(B, nkv, L, D)
    keys, values = prefix.keys[layer], prefix.values[layer]
    own = torch.matmul(rows, k.transpose(-1, -2)).add_(_per_query_head(mask, L // T))  # [B, nkv, L, S]
    shared = prefix.unstack(torch.matmul(prefix.stack(rows), keys.transpose(-1, -2)).add_(prefix.mask))
    p = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1)
    o = torch.matmul(p[..., keys.shape[2]:], v)
    o += prefix.unstack(torch.matmul(prefix.stack(p[..., :keys.shape[2]]), values))
    return o.reshape(B, nq, T, D)


class SharedPrefix:
    """The cache positions that several rows share: ``keys``/``values`` [U, nkv, P, D] per layer, ``mask``
    [U, 1, 1, P] (0 on a valid position, -inf on padding; ``valid``, [U, P], True there), and ``rows`` (row b reads
    prefix ``rows[b]``; ``row``, the same as a tensor).  A
    prefix's rows take ``width`` consecutive query slots in ``split_attention``: ``slot`` [B] says which (None
    where row b is slot b already)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor, rows: list[int]):
        self.keys, self.values, self.valid = keys, values, valid
        self.mask = _additive(valid, keys[0].dtype)[:, None, None]
        self.set_rows(rows)

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """Rows' [B, H, L, X] as their prefixes' [U, H, width * L, X] (slots no row takes hold zeros)."""
        U, m = self.count, self.width
        if self.slot is not None:
            x = x.new_zeros((U * m,) + x.shape[1:]).index_copy_(0, self.slot, x)
        H, L, X = x.shape[1:]
        return x.reshape(U, m, H, L, X).transpose(1, 2).reshape(U, H, m * L, X)

    def unstack(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of ``stack``: prefixes' [U, H, width * L, X] as rows' [B, H, L, X]."""
        U, H, mL, X = y.shape
        y = y.view(U, H, self.width, mL // self.width, X).transpose(1, 2).reshape(U * self.width, H, -1, X)
        return y if self.slot is None else y.index_select(0, self.slot)

    def set_rows(self, rows: list[int]) -> None:
        """Row b now reads prefix ``rows[b]``; prefixes no row reads are dropped."""
        used = sorted(set(rows))
        if len(used) < len(self.keys[0]):
            keep = torch.tensor(used, device=self.mask.device)
            new = {u: i for i, u in enumerate(used)}
            rows = [new[r] for r in rows]
            self.keys = [t.index_select(0, keep) for t in self.keys]
            self.values = [t.index_select(0, keep) for t in self.values]
            self.mask, self.valid = self.mask.index_select(0, keep), self.valid.index_select(0, keep)
        self.rows, self.count = rows, len(used)
        self.row = torch.tensor(rows, device=self.mask.device)  # the rows' prefixes as a tensor (the kernel's)
        seen = [0] * self.count
        slots = []
        for r in rows:
            slots.append(seen[r])
            seen[r] += 1
        self.width = max(seen)
        slots = [r * self.width + s for r, s in zip(rows, slots)]
        in_place = slots == list(range(self.count * self.width))
        self.slot = None if in_place else torch.tensor(slots, device=self.mask.device)


def _matmul(x: torch.Tensor, packed: Packed, few=None, norm: torch.nn.Module | None = None,
            gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., in] times the packed [out, in] weight, plus its bias, plus ``residual`` [..., out] where one is
    given; first normalised by the RMS norm module ``norm`` where one is given, or, with ``gated``, ``x`` =
    [gate | up] [..., 2 in] becomes ``silu(gate) * up``.  Where the kernel ``few`` is given (a module from
    ``few_rows.kernel()``, which also does the norm or the gating), at most ``few_rows.MAX_ROWS`` rows go to its
    ``linear_rows`` and more to its ``linear_panels`` (the residual added in its sums); otherwise a oneDNN weight
    goes to oneDNN's linear, and any other is multiplied as ``weight @ x^T``, whose result [..., out] is a
    transposed view (its rows are strided), which the element-wise operations and views after it take as is."""
    bias, added = packed.bias, False
    if few is not None and x.numel() <= few_rows.MAX_ROWS * x.shape[-1]:
        y = few_rows.linear_rows(few, x, packed.parts, norm, gated)
    elif few is not None:
        added = residual is not None and bias is None  # the panels' sums start from the residual
        y = few_rows.linear_panels(few, x, packed.panels(few), packed.out, norm, gated, residual if added else None)
    else:
        if norm is not None:
            x = _rms(x, norm)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        if packed.weight.is_mkldnn:
            y, bias = torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], ""), None
        else:
            y = (packed.weight @ x.reshape(-1, x.shape[-1]).t()).t().view(*x.shape[:-1], packed.weight.shape[0])
    if bias is not None:
        y = y + bias
    return y if residual is None or added else residual + y


class LeanDecoder:
    def __init__(self, model: torch.nn.Module, cuda_graphs: bool = True, shared_prefix: bool = True,
                 shared_prefix_min_elements: int = SHARED_PREFIX_MIN_ELEMENTS, few_row_kernel: bool = True):
        if not lean_supported(model):
            raise ValueError(f"the lean decoder does not support {type(model).__name__}")
        cfg = model.config
        self.model, self.body = model, model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self._packed_key: tuple | None = None
        self.cuda_graphs = cuda_graphs
        self.shared_prefix = shared_prefix  # off: repeated rows copy the cache everywhere
        self.shared_prefix_min_elements = shared_prefix_min_elements  # prefix_pays
        self.few_row_kernel = few_row_kernel  # few_rows on x86 CPUs in float32: products of at most MAX_ROWS rows,
        # and every decode step's attention
        self.few = None  # the kernel's module while the weights and norms suit it (_pack)
        self._graph: _DecodeGraph | None = None

    def weights_changed(self) -> None:
        """Repack at the next generation: for weights written where no tensor's version sees it (shared memory
        another process writes)."""
        self._packed_key = None

    def _pack(self) -> None:
        """(Re)make the packed weights (their stacked copies left to the first product that needs them) if any
        weight of the module changed since they were made."""
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in self.model.parameters())
        if key == self._packed_key:
            return
        with torch.no_grad():
            self.layers = []
            for layer in self.body.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append((Packed([attn.q_proj, attn.k_proj, attn.v_proj]), Packed([attn.o_proj]),
                                    Packed([mlp.gate_proj, mlp.up_proj]), Packed([mlp.down_proj])))
            self.head = Packed([self.model.lm_head])
        parts = [w for packed in (*(p for layer in self.layers for p in layer), self.head) for w in packed.parts]
        parts += [self.body.norm.weight] + [n.weight for layer in self.body.layers
                                            for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.few = (few_rows.kernel() if self.few_row_kernel and all(
            w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in parts) else None)
        self._packed_key = key

    def start(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the cache for ``batch`` rows of up to ``capacity`` positions, and the rotary table."""
        self._graph = None  # it holds the old cache's addresses
        self._pack()
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        self.key_valid = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
        self.length, self.capacity = 0, capacity
        self.prefix: SharedPrefix | None = None
        probe = torch.zeros((1, capacity, 1), dtype=dtype, device=device)
        cos, sin = self.body.rotary_emb(probe, torch.arange(capacity, device=device)[None])
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half of sin negated
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def release(self) -> None:
        """Free the cache, and the graph that holds its addresses, until the next ``start``: between generations
        the decoder keeps only the packed weights (`hpc-rlhf plan` counts the cache as living during generation,
        and a colocated actor trains in that memory)."""
        self._graph = None
        self.keys, self.values, self.key_valid, self.prefix = [], [], None, None

    @property
    def offset(self) -> int:
        """The cache position of the row caches' first slot: the shared prefix's length (0 without one)."""
        return 0 if self.prefix is None else self.prefix.keys[0].shape[2]

    def shares_prefix(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``select_rows`` that repeats rows shares their cache so far (``split_attention``) instead of
        copying it: where ``shared_prefix`` is on, on the CPU in float32, where it was measured
        (``split_attention`` takes its softmax in the cache's dtype; a graph's step attends over one whole cache)."""
        return self.shared_prefix and device.type == "cpu" and dtype == torch.float32 and not self.graphed(device)

    def select_rows(self, index: torch.Tensor) -> None:
        """Row r of the cache becomes row ``index[r]``: prompts prefilled once serve several samples, and
        finished rows leave the batch.  Only the positions written so far are copied (a forward reads no key
        past the ones it writes), one layer at a time, so the old and new caches never both exist whole.
        Where ``shares_prefix`` and the sharing pays (``prefix_pays``), repeating rows (a prompt's samples) keeps
        the cache so far once per distinct row as a ``SharedPrefix`` and starts each row's own cache after it."""
        self._graph = None
        rows = index.tolist()
        if self.prefix is not None:
            self.prefix.set_rows([self.prefix.rows[r] for r in rows])
        elif (self.shares_prefix(self.keys[0].dtype, index.device)
              and prefix_pays(rows, self.length, self.kv_heads, self.head_dim, self.shared_prefix_min_elements)):
            n = self.length
            self.prefix = SharedPrefix([t[:, :, :n].contiguous() for t in self.keys],
                                       [t[:, :, :n].contiguous() for t in self.values], self.key_valid[:, :n], rows)
            shape = (len(rows), self.kv_heads, self.capacity - n, self.head_dim)
            self.keys = [t.new_empty(shape) for t in self.keys]
            self.values = [t.new_empty(shape) for t in self.values]
            self.key_valid = self.key_valid.new_zeros((len(rows), self.capacity - n))
            return

        def pick(t: torch.Tensor) -> torch.Tensor:  # zeros past the written slots: a graphed step reads them
            out = (t.new_zeros if self.graphed(t.device) else t.new_empty)((len(index),) + t.shape[1:])
            n = self.length - self.offset
            out[:, :, :n] = t[:, :, :n].index_select(0, index)
            return out
        for cache in (self.keys, self.values):
            for i, t in enumerate(cache):
                cache[i] = pick(t)
        self.key_valid = self.key_valid.index_select(0, index)

    def _mask(self, T: int, start: int, end: int, device) -> torch.Tensor:
        """Which of the row caches' slots [0, end) the new slots [start, end) see: [B, 1, T or 1, end]; with a
        shared prefix the slots count from its end, and the mask is additive (0 or -inf) for ``split_attention``."""
        if T == 1:  # one new token per row: it sees every valid cached key and itself
            allowed = self.key_valid[:, None, None, :end]
        else:
            slots = torch.arange(start, end, device=device)
            keys = torch.arange(end, device=device)
            allowed = (keys[None, :] <= slots[:, None])[None] & self.key_valid[:, None, :end]
            allowed |= keys[None, None, :] == slots[None, :, None]  # padded queries see themselves: no empty rows
            allowed = allowed[:, None]
        if self.prefix is None:
            return allowed
        return _additive(allowed, self.keys[0].dtype)

    def graphed(self, device: torch.device) -> bool:
        """Whether ``decode`` replays CUDA graphs on ``device``."""
        return self.cuda_graphs and device.type == "cuda"

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append ``ids`` [B, T] (``valid`` False on padding) and return the last position's logits [B, V]."""
        T = ids.shape[1]
        start, end = self.length - self.offset, self.length - self.offset + T  # slots of the row caches
        self.key_valid[:, start:end] = valid

        def store(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            return self.keys[i][:, :, :end], self.values[i][:, :, :end]
        if self.few is not None and T == 1:  # a decode step in the kernel, which needs no mask
            logits = self._layers(ids, positions, None, store, start)
        else:
            logits = self._layers(ids, positions, self._mask(T, start, end, ids.device), store)
        self.length += T
        return logits

    def step_at(self, ids: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Append one token per row, ``ids`` [B, 1], at cache slot ``slot`` (a one-element long tensor on the
        cache's device) and return its logits [B, V], attending over the whole cache with the slots not yet
        written masked out: the shapes are the batch's and the capacity's at every step, as a graph needs.
        ``self.length`` is left to the caller."""
        self.key_valid.index_fill_(1, slot, True)

        def store(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys[i].index_copy_(2, slot, k)
            self.values[i].index_copy_(2, slot, v)
            return self.keys[i], self.values[i]
        return self._layers(ids, positions, self.key_valid[:, None, None, :], store)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row, ``ids`` [B, 1] at ``positions`` [B, 1], and return the logits [B, V]: a
        replay of this batch's CUDA graph where ``graphed``, else ``forward``."""
        if not self.graphed(ids.device):
            return self.forward(ids, positions, torch.ones_like(ids, dtype=torch.bool))
        if self._graph is None:
            self._graph = _DecodeGraph(self, ids, positions)
        logits = self._graph.replay(ids, positions)
        self.length += 1
        return logits

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, store,
                slot: int | None = None) -> torch.Tensor:
        """The layers over ``ids`` [B, T] under ``mask``; ``store(i, keys, values)`` puts layer i's new keys and
        values [B, nkv, T, D] in the cache and returns the keys and values to attend to.  With ``slot`` (a decode
        step, T = 1, where the kernel runs), the kernel writes the row caches' slot ``slot`` and attends without a
        mask or ``store``.  The last position's logits."""
        B, T = ids.shape
        nq, nkv, D = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, :, None], self.signed_sin[positions][:, :, None]  # [B, T, 1, D]
        h = self.body.embed_tokens(ids)
        split = (nq + nkv) * D  # queries and keys | values
        # a decode step in the kernel: rotation and cache write in one pass, then attention, over the shared prefix too
        few_step = slot is not None
        if few_step:
            cos, sin = cos.reshape(B, D).contiguous(), sin.reshape(B, D).contiguous()
        for i, layer in enumerate(self.body.layers):
            qkv_w, o_w, gate_up_w, down_w = self.layers[i]
            qkv = _matmul(h, qkv_w, self.few, layer.input_layernorm).contiguous()  # attention's kernel: whole rows
            if few_step:
                q = self.few.rope_store(qkv.view(B, -1), cos, sin, self.keys[i], self.values[i], slot, nq)
                shared = () if self.prefix is None else (self.prefix.keys[i], self.prefix.values[i], self.prefix.valid,
                                                         self.prefix.row)
                o = self.few.attend_one(q, self.keys[i][:, :, :slot + 1], self.values[i][:, :, :slot + 1],
                                        self.key_valid[:, :slot + 1], self.scale, *shared).view(B, T, -1)
            else:
                qk = qkv[..., :split].view(B, T, nq + nkv, D)
                qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
                keys, values = store(i, qk[:, :, nq:].transpose(1, 2),
                                     qkv[..., split:].view(B, T, nkv, D).transpose(1, 2))
                q = qk[:, :, :nq].transpose(1, 2)
                o = (grouped_attention(q, keys, values, mask, self.scale) if self.prefix is None
                     else split_attention(q, self.prefix, i, keys, values, mask, self.scale))
                o = o.transpose(1, 2).reshape(B, T, -1)
            h = _matmul(o, o_w, self.few, residual=h)
            gate_up = _matmul(h, gate_up_w, self.few, layer.post_attention_layernorm)
            h = _matmul(gate_up, down_w, self.few, gated=True, residual=h)
        return _matmul(h[:, -1], self.head, self.few, self.body.norm).contiguous()  # rows whole for the sampling


class _DecodeGraph:
    """A ``LeanDecoder`` decode step captured as a CUDA graph for one batch and cache: each replay copies the
    inputs into the graph's own buffers, launches every kernel of the step at once, and moves the graph's cache
    slot on by one.  Captured at the decoder's current length, with that step's inputs."""

    def __init__(self, dec: LeanDecoder, ids: torch.Tensor, positions: torch.Tensor):
        device = ids.device
        self.ids, self.positions = ids.clone(), positions.clone()
        self.slot = torch.full((1,), dec.length, dtype=torch.long, device=device)
        # A warm-up outside the graph (lazy initialisation, kernel choices) on a side stream, as capture needs.
        # It writes the slot that the first replay writes again with the same inputs, so it changes nothing.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dec.step_at(self.ids, self.positions, self.slot)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.logits = dec.step_at(self.ids, self.positions, self.slot)
            self.slot.add_(1)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's own output
