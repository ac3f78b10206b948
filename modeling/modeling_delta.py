"""Delta-attention decoder: Llama-family blocks whose token mixers are delta attention or softmax attention.

Delta layers keep one fixed-size state per head (see `delta_reference.py` for the maths), stored in
`DeltaLinearAttentionLayer` cache entries (transformers' `LinearAttentionLayer` counting its tokens, see
`delta_cache.py`); softmax layers use the usual KV cache entries. Which layer is which comes from
`config.layer_types`, so `DeltaCache(config=...)`, `DynamicCache(config=...)` and `StaticCache` build the right mix.
Long prompts have their own path, `DeltaForCausalLM.prefill`, which `generate` uses too.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_io import load_cache, save_cache  # noqa: F401  (saved states ship with every checkpoint's code)
from .configuration_delta import DeltaConfig
from .delta_cache import (
    DEFAULT_MAX_ROLLBACK, DeltaCache, DeltaLinearAttentionLayer, cached_length, stop_recording, use_delta_layers,
)
from .compiled_step import ACTIVATIONS, TokenStepSpec, TokenStepWeights, compiled_layer_token_step
from .delta_block import block_delta_rule
from .delta_prefill import KeptHidden, release_freed_memory
from .delta_rule import chunk_delta_rule, delta_step_inplace, recurrent_delta_rule
from .few_rows_linear import DeltaLinear, few_rows_linear
from .packed_linear import MIN_PACKED_BYTES, pack_linear_weights, unpack_linear_weights
from .short_conv import causal_conv


MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "linear_attention": create_recurrent_attention_mask,
}


L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, for y > 0 (y clamped to at least 1e-6)."""
    y = y.clamp(min=1e-6)
    return y + torch.log(-torch.expm1(-y))


class DeltaRMSNorm(LlamaRMSNorm):
    pass


class DeltaHeadRMSNorm(nn.Module):
    """RMSNorm over each head's value dimension, with its own weight for every channel of every head."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [B, T, H, V]
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.view(self.num_heads, self.head_dim) * hidden_states).to(input_dtype)


def _intercepted(module: nn.Module) -> bool:
    """Whether something runs around `module`'s forward when it is called: an accelerate hook, or a forward (pre-)hook
    of its own or a global one. Code that computes a module's maths without calling it (`FusedLinear`, the compiled
    decode step) must not skip those, so it leaves such a module to its own forward."""
    return ("_hf_hook" in module.__dict__ or bool(module._forward_hooks or module._forward_pre_hooks)
            or bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks))


class FusedLinear:
    """Several `nn.Linear`s that read the same input, as one matmul, without a second copy of their weights: their
    weights are moved into one tensor [sum of out_features, in_features] (their biases into one [sum of out_features],
    zeros where a layer has none) and each layer's parameters become views of its rows. For inference (no autograd
    through the fused product; the layers themselves still train through their views).

    Not a module and not a buffer, so nothing of it reaches `state_dict` or a checkpoint: the layers keep their own
    parameters and names, and `save_pretrained` writes each view as a tensor of its own. Anything that gives a
    parameter new memory (`.to()`, `load_state_dict(assign=True)`, `param.data = ...`, a swapped layer) leaves it
    off its rows, which `is_current` tells; writes in place (`copy_`, `load_state_dict`, optimizer steps, a LoRA
    merge) land in the fused tensor itself. `release` gives every layer still on its rows memory of its own again.
    """

    def __init__(self, linears: list[nn.Linear]):
        # a normal tensor even when first used under `torch.inference_mode()`: the parameters become views of it
        with torch.inference_mode(False), torch.no_grad():  # (this order: inference_mode(False) enables grad)
            self.weight = torch.cat([linear.weight for linear in linears])  # [sum of out_features, in_features]
            self.bias = None
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None
                                       else linear.bias for linear in linears])
            # per layer: its parameters and where their views of the fused rows are (pointer, shape, stride, dtype,
            # device), which `is_current` and `release` compare without slicing again (a decode step checks every layer)
            self._rows: list[tuple[nn.Parameter, nn.Parameter | None, tuple, tuple | None]] = []
            start = 0
            for linear in linears:
                stop = start + linear.out_features
                linear.weight.data = self.weight[start:stop]
                if linear.bias is not None:
                    linear.bias.data = self.bias[start:stop]
                self._rows.append((linear.weight, linear.bias, self._where(linear.weight),
                                   None if linear.bias is None else self._where(linear.bias)))
                start = stop

    @staticmethod
    def _plain(linear: nn.Module) -> bool:
        # a plain `nn.Linear` or `DeltaLinear` (not a PEFT or quantized wrapper) that nothing intercepts (the fused
        # product does not call the layer)
        return type(linear) in (nn.Linear, DeltaLinear) and not _intercepted(linear)

    @staticmethod
    def fits(linears: list[nn.Module]) -> bool:
        """Whether `linears` can be fused: plain `nn.Linear`s (not PEFT or quantized wrappers, no accelerate or
        forward hooks) with whole weights (not meta, not sharded away as ZeRO-3 does outside a layer's own forward)
        of one dtype and device."""
        if not all(FusedLinear._plain(linear) for linear in linears):
            return False
        weights = [linear.weight for linear in linears]
        return weights[0].device.type != "meta" and all(
            w.dtype == weights[0].dtype and w.device == weights[0].device
            and w.shape == (linear.out_features, linear.in_features) for w, linear in zip(weights, linears)
        )

    @staticmethod
    def _where(tensor: torch.Tensor) -> tuple:
        # where a tensor's data is; while the fused tensors live, no other tensor can have a view's `_where`
        return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device

    def is_current(self, linears: list[nn.Module]) -> bool:
        """Whether `linears` are still the plain `nn.Linear`s fused, each parameter on its rows of the fused tensors."""
        if len(linears) != len(self._rows):
            return False
        for linear, (weight, bias, weight_rows, bias_rows) in zip(linears, self._rows):
            if not (self._plain(linear) and linear.weight is weight and linear.bias is bias
                    and self._where(weight) == weight_rows and (bias is None or self._where(bias) == bias_rows)):
                return False
        return True

    def release(self) -> None:
        """Give every parameter still on its rows memory of its own (a copy), so that the fused tensors are freed."""
        with torch.no_grad():
            for weight, bias, weight_rows, bias_rows in self._rows:
                for parameter, rows in ((weight, weight_rows), (bias, bias_rows)):
                    if parameter is not None and self._where(parameter) == rows:
                        parameter.data = parameter.data.clone()
        self._rows = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] -> [..., sum of out_features]: the layers' outputs side by side
        if DeltaLinear.few_rows:
            return few_rows_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _state_dict_without_fused_views(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A `state_dict` post-hook: the entries that are views of a layer's fused input projection become copies of their
    own, so no caller sees tensors sharing memory (safetensors' `save_model` refuses disjoint views of one tensor, and
    accelerate's `save_model` would keep only one of them). Parameters (`keep_vars=True`) stay as they are."""
    fused = module.__dict__.get("_fused_inputs")
    if fused is None:
        return
    storages = {t.untyped_storage().data_ptr() for t in (fused.weight, fused.bias) if t is not None}
    for name in module.input_projections:
        for kind in ("weight", "bias"):
            key = f"{prefix}{name}.{kind}"
            value = state_dict.get(key)
            if (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
                    and value.untyped_storage().data_ptr() in storages):
                state_dict[key] = value.clone()


class PackedDocuments:
    """The documents packed into the rows of a batch (position ids restarting at 0, as `DataCollatorWithFlattening`
    produces), and the maps between the packed rows and a right-padded batch of one document per row.

    A delta layer runs that batch with a zero state and an empty conv window per document, so each document is
    computed exactly as it would be alone (docs/design.md, "Pitfalls handled")."""

    def __init__(self, document_ids: torch.Tensor):
        # document_ids [B, T]: 0, 0, 1, 1, 1, 2, ... per row (`find_packed_sequence_indices`)
        batch, seq_len = document_ids.shape
        counts = document_ids[:, -1] + 1  # documents per row [B]
        flat = (document_ids + (counts.cumsum(0) - counts)[:, None]).reshape(-1)  # global document of each token
        self.num_documents = int(counts.sum())
        token = torch.arange(batch * seq_len, device=flat.device)
        first = torch.full((self.num_documents,), batch * seq_len, device=flat.device)
        first = first.scatter_reduce(0, flat, token, "amin")  # first token of each document
        self.max_length = int(torch.bincount(flat, minlength=self.num_documents).max())
        self.slots = flat * self.max_length + token - first[flat]  # [B * T]: where each token goes in the batch

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [documents, longest, D], each document from position 0, zeros after its end."""
        rows = packed.new_zeros(self.num_documents * self.max_length, packed.shape[-1])
        rows = rows.index_copy(0, self.slots, packed.reshape(-1, packed.shape[-1]))
        return rows.view(self.num_documents, self.max_length, -1)

    def pack(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Inverse of `unpack`: [documents, longest, D] -> the shape of `like`, [B, T, D]."""
        return rows.reshape(-1, rows.shape[-1]).index_select(0, self.slots).view(*like.shape[:-1], -1)


class DeltaAttention(nn.Module):
    """Delta attention: short conv, L2-normalised q/k, beta, decay gate, delta-rule state, gated output norm.

    The layer owns its parametrisation: `new_parameters()` lists what softmax attention lacks, and
    `decay_at_rest` / `beta_at_rest` read (their `set_` forms write) the per-state decay and beta at zero input.

    H query heads (`num_heads`) read `num_state_heads` states: H of them, or one per KV head with
    `config.linear_state_sharing == "kv_head"` (k, v, beta and decay are then per KV head, query head h reading
    state h // (H / H_kv)).
    """

    # the parameters a delta layer shares with softmax attention (by name); everything else is new
    COPIED_FROM_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    # `set_decay_at_rest` / `set_beta_at_rest` clamp their inputs to these ranges
    DECAY_AT_REST_RANGE = (0.5, 0.9999)
    BETA_AT_REST_RANGE = (1e-3, 1 - 1e-3)
    # inference without autograd (eval mode, no grad) runs blocks of up to SHORT_BLOCK_TOKENS new tokens on a CPU cache
    # (a decode step, a speculative verification, also while the cache records for a rollback) through
    # `_inference_step`; False (on the class or a layer) keeps the reference path. `fuse_projections` also reads all
    # input projections with one matmul (`FusedLinear`, their weights moved into one tensor, no copy): bf16 decoding
    # measured 10% faster with it (docs/design.md, "Fast inference path"); False keeps one matmul per projection
    fast_inference = True
    fuse_projections = True
    # blocks up to this many tokens solve the delta rule as one closed-form block at inference (`block_delta_rule`)
    # instead of the chunked kernel, which costs a whole chunk however few tokens it holds (two threads, 9 heads of
    # 64, per-head decay: 0.25 against 1.1 ms for 11 tokens, 0.52 against 1.1 for 32; docs/design.md, "Fast
    # inference path")
    SHORT_BLOCK_TOKENS = 32

    def __init__(self, config: DeltaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads  # query heads, one output each
        self.num_state_heads = config.linear_num_state_heads  # states, with their own k, v, beta and decay
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.key_dim = self.num_heads * self.key_head_dim  # q width
        self.value_dim = self.num_heads * self.value_head_dim  # output width (o_norm, g_proj, o_proj)
        self.state_key_dim = self.num_state_heads * self.key_head_dim  # k width
        self.state_value_dim = self.num_state_heads * self.value_head_dim  # v width
        self.gate = config.linear_gate
        self.conv_kernel_size = config.linear_conv_kernel_size
        self.chunk_size = config.linear_chunk_size
        self.allow_neg_eigval = config.linear_allow_neg_eigval
        self.log_decay_floor = config.linear_log_decay_floor
        hidden = config.hidden_size

        self.q_proj = DeltaLinear(hidden, self.key_dim, bias=config.attention_bias)
        self.k_proj = DeltaLinear(hidden, self.state_key_dim, bias=config.attention_bias)
        self.v_proj = DeltaLinear(hidden, self.state_value_dim, bias=config.attention_bias)
        self.o_proj = DeltaLinear(self.value_dim, hidden, bias=config.attention_out_bias)
        self.b_proj = DeltaLinear(hidden, self.num_state_heads, bias=True)

        if self.gate == "scalar":
            self.a_proj = DeltaLinear(hidden, self.num_state_heads, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(self.num_state_heads))
        elif self.gate == "channel":
            self.a_proj = DeltaLinear(hidden, config.linear_gate_low_rank_dim, bias=False)
            self.a_up_proj = DeltaLinear(config.linear_gate_low_rank_dim, self.state_key_dim, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(self.state_key_dim))
        if self.gate != "none":
            self.A_log = nn.Parameter(torch.zeros(self.num_state_heads))

        if self.conv_kernel_size > 0:  # over the [q | k | v] channels
            conv_dim = self.key_dim + self.state_key_dim + self.state_value_dim
            self.conv1d = nn.Conv1d(
                conv_dim, conv_dim, self.conv_kernel_size, groups=conv_dim, padding=self.conv_kernel_size - 1, bias=False
            )
            self.conv_act = ACT2FN[config.linear_conv_activation] if config.linear_conv_activation else nn.Identity()

        if config.use_qk_norm:
            self.q_norm = DeltaRMSNorm(self.key_head_dim, eps=config.rms_norm_eps)
            self.k_norm = DeltaRMSNorm(self.key_head_dim, eps=config.rms_norm_eps)
        self.o_norm = DeltaHeadRMSNorm(self.num_heads, self.value_head_dim, eps=config.rms_norm_eps)
        if config.linear_output_gate:
            self.g_proj = DeltaLinear(hidden, self.value_dim, bias=True)
            self.gate_act = ACT2FN[config.linear_output_gate_activation]

        # the projections of the layer's input, in the order `FusedLinear` concatenates them, and their widths
        self.input_projections = ("q_proj", "k_proj", "v_proj", "b_proj") + ("a_proj",) * (self.gate != "none") + (
            ("g_proj",) * bool(config.linear_output_gate))
        self.input_widths = [self.key_dim + self.state_key_dim + self.state_value_dim, self.num_state_heads]
        if self.gate != "none":
            self.input_widths.append(self.a_proj.out_features)
        if config.linear_output_gate:
            self.input_widths.append(self.value_dim)
        self._fused_inputs: FusedLinear | None = None
        self.register_state_dict_post_hook(_state_dict_without_fused_views)

    def __setattr__(self, name, value):
        if name in self.__dict__.get("input_projections", ()):  # a projection swapped (PEFT wrapping or unloading)
            self._release_fused_inputs()
        super().__setattr__(name, value)

    def _release_fused_inputs(self) -> None:
        # the projections' parameters back in memory of their own (`FusedLinear.release`), the fused tensors freed
        fused = self.__dict__.get("_fused_inputs")
        if fused is not None:
            fused.release()
        self.__dict__["_fused_inputs"] = None

    def _apply(self, fn, recurse=True):
        # `.to()`, `.half()`, ...: fused again from the converted weights when next used; a parameter `fn` left in
        # place (a `.to()` to where it already is) still views the old rows and gets its own memory back
        module = super()._apply(fn, recurse)
        self._release_fused_inputs()
        return module

    def train(self, mode: bool = True):
        if mode:
            self._release_fused_inputs()  # training reads the projections one by one, each from its own memory
        return super().train(mode)

    def _fused_input_projection(self) -> FusedLinear | None:
        """The input projections as one `FusedLinear`, built on first use and again whenever a parameter left its
        rows (new memory, a swapped layer); None when they cannot be fused (`FusedLinear.fits`)."""
        linears = [getattr(self, name) for name in self.input_projections]
        if self._fused_inputs is not None and self._fused_inputs.is_current(linears):
            return self._fused_inputs
        self._release_fused_inputs()  # no parameter keeps viewing stale rows, whether or not the layers fuse again
        if FusedLinear.fits(linears):
            self._fused_inputs = FusedLinear(linears)
        return self._fused_inputs

    def _inference_fast(self) -> bool:
        # the fast paths run only where no gradient can be needed, and eagerly (torch.compile traces the reference:
        # it fuses the small ops itself and cannot trace `FusedLinear.is_current`)
        return (self.fast_inference and not self.training and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def _project_inputs(self, hidden_states: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """[..., hidden] -> (q|k|v [..., D], b [..., Hs], a [..., Hs or low rank] or None without a decay gate,
        g [..., H * V] or None without an output gate). One matmul (`FusedLinear`) at inference when the
        projections are plain `nn.Linear`s; one per projection otherwise (the reference)."""
        fused = self._fused_input_projection() if self.fuse_projections and self._inference_fast() else None
        if fused is not None:
            pieces = list(fused(hidden_states).split(self.input_widths, dim=-1))
        else:
            mixed_qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states),
                                   self.v_proj(hidden_states)], -1)
            pieces = [mixed_qkv] + [getattr(self, name)(hidden_states) for name in self.input_projections[3:]]
        mixed_qkv, b = pieces[:2]
        a = pieces[2] if self.gate != "none" else None
        g = pieces[-1] if self.config.linear_output_gate else None
        return mixed_qkv, b, a, g

    def _short_conv(self, mixed_qkv: torch.Tensor, cache: Cache | None, attention_mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
        # mixed_qkv: [B, T, D] -> causal depthwise conv over T, continuing from the cached last inputs;
        # attention_mask [B, T] (2D padding mask) or None
        seq_len = mixed_qkv.shape[1]
        conv_input = mixed_qkv.transpose(1, 2)  # [B, D, T]
        if cache is not None:
            # returns [cached inputs | new inputs] (or the new inputs left-padded on a first call)
            conv_input = cache.update_conv_state(conv_input, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        if attention_mask is not None:
            return self.conv_act(self._short_conv_skipping_masked(conv_input, attention_mask, cache).transpose(1, 2))
        return self.conv_act(causal_conv(conv_input.transpose(1, 2), self.conv1d.weight[:, 0], seq_len))

    def _short_conv_skipping_masked(self, conv_input: torch.Tensor, attention_mask: torch.Tensor,
                                    cache: Cache | None) -> torch.Tensor:
        """The short conv over each row's unmasked inputs only (docs/design.md, "Padding"): a masked position takes
        no tap, so the output equals that of the row with its masked tokens removed. conv_input [B, D, P + T] (P
        cached or zero-padded inputs, all kept, then the T new ones), attention_mask [B, T] -> [B, D, T] (the
        outputs at masked positions are unused). The cache's conv window becomes the last unmasked inputs."""
        channels, length = conv_input.shape[1:]
        keep = F.pad(attention_mask.bool(), (length - attention_mask.shape[1], 0), value=True)  # [B, P + T]
        # stable sort: each row's kept inputs first, in their order; masked ones (zeros) last
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        compact = conv_input.gather(-1, order[:, None].expand(-1, channels, -1))  # [B, D, P + T]
        out = causal_conv(compact.transpose(1, 2), self.conv1d.weight[:, 0]).transpose(1, 2)  # [B, D, P + T]
        slot = keep.cumsum(-1) - 1  # [B, P + T]: the index of each kept input in `compact` (-1 before the first)
        taps = slot[:, None, -attention_mask.shape[1] :].clamp(min=0)  # [B, 1, T]
        out = out.gather(-1, taps.expand(-1, channels, -1))  # [B, D, T]
        if cache is not None:  # the last K kept inputs, zeros before a row's first: [B, D, K]
            width = self.conv_kernel_size
            last = slot[:, -1:] + 1 + torch.arange(width, device=slot.device)  # [B, K], into the padded `compact`
            window = F.pad(compact, (width, 0)).gather(-1, last[:, None].expand(-1, channels, -1))
            cache.layers[self.layer_idx].replace_conv_state(window)
        return out

    # ------------------------------------------------------------------------------------------------------
    # parametrisation: the maps from the layer's parameters to decay and beta, next to their inverses

    def new_parameters(self) -> list[nn.Parameter]:
        """The parameters this layer has and softmax attention lacks (all but `COPIED_FROM_ATTENTION`)."""
        return [p for name, p in self.named_parameters() if name.split(".")[0] not in self.COPIED_FROM_ATTENTION]

    def _decay_map(self, a: torch.Tensor) -> torch.Tensor:
        # Mamba2-style log-decay g = -exp(A_log) * softplus(a + dt_bias) of the gate input a, per state (Hs):
        # a [..., Hs] -> g [..., Hs] (scalar gate); a [..., Hs * K] -> g [..., Hs, K] (channel gate);
        # clamped to at least `linear_log_decay_floor` where the config sets one
        a = a.float() + self.dt_bias.float()
        if self.gate == "scalar":
            log_decay = -self.A_log.float().exp() * F.softplus(a)
        else:
            a = a.unflatten(-1, (self.num_state_heads, self.key_head_dim))
            log_decay = -self.A_log.float().exp()[:, None] * F.softplus(a)
        return log_decay if self.log_decay_floor is None else log_decay.clamp(min=self.log_decay_floor)

    def _log_decay(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # [B, T, hidden] -> log-decay [B, T, Hs] (scalar gate) or [B, T, Hs, K] (channel gate); None without a gate
        if self.gate == "none":
            return None
        return self._gate_log_decay(self.a_proj(hidden_states))

    def _gate_log_decay(self, a: torch.Tensor | None) -> torch.Tensor | None:
        # a_proj's output [..., Hs] (scalar gate) or [..., low rank] (channel gate) -> log-decay; None without a gate
        if a is None:
            return None
        return self._decay_map(a if self.gate == "scalar" else self.a_up_proj(a))

    @torch.no_grad()
    def decay_at_rest(self) -> torch.Tensor | None:
        """Per-state decay factor a in (0, 1) at zero input (the state is multiplied by a every token): [Hs].

        For the channel gate, the mean over each head's channels of the log-decay, exponentiated. None for the
        gate "none" (no decay)."""
        if self.gate == "none":
            return None
        log_decay = self._decay_map(torch.zeros_like(self.dt_bias))  # the gate projections have no bias
        if self.gate == "channel":
            log_decay = log_decay.mean(-1)
        return log_decay.exp()

    @torch.no_grad()
    def set_decay_at_rest(self, decay: torch.Tensor) -> None:
        """Inverse of `decay_at_rest`: A_log = 0 and dt_bias = softplus^-1(-log a) (the same for every channel of
        a head with the channel gate), with `decay` [Hs] clamped to `DECAY_AT_REST_RANGE`. No-op for the gate
        "none"."""
        if self.gate == "none":
            return
        decay = decay.float().clamp(*self.DECAY_AT_REST_RANGE)
        dt = inverse_softplus(-torch.log(decay))  # softplus(dt_bias) = -log(a) with A = exp(A_log) = 1
        if self.gate == "channel":
            dt = dt.repeat_interleave(self.key_head_dim)
        self.A_log.zero_()
        self.dt_bias.copy_(dt.to(self.dt_bias.dtype))

    def _beta(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [B, T, hidden] -> beta [B, T, Hs] in (0, 1), or in (0, 2) with negative eigenvalues allowed
        return self._beta_map(self.b_proj(hidden_states))

    def _beta_map(self, b: torch.Tensor) -> torch.Tensor:
        beta = b.float().sigmoid()
        return beta * 2.0 if self.allow_neg_eigval else beta

    @torch.no_grad()
    def beta_at_rest(self) -> torch.Tensor:
        """Per-state beta at zero input: [Hs] (`b_proj`'s bias through the beta map)."""
        return self._beta_map(self.b_proj.bias)

    @torch.no_grad()
    def set_beta_at_rest(self, beta: torch.Tensor) -> None:
        """Inverse of `beta_at_rest`: b_proj.bias = logit(beta) (logit(beta / 2) with negative eigenvalues allowed),
        with the sigmoid's argument clamped to `BETA_AT_REST_RANGE`."""
        beta = beta.float()
        if self.allow_neg_eigval:
            beta = beta / 2
        beta = beta.clamp(*self.BETA_AT_REST_RANGE)
        self.b_proj.bias.copy_(torch.log(beta / (1 - beta)).to(self.b_proj.bias.dtype))

    def _identity_conv_weight(self) -> torch.Tensor:
        """A short-conv weight that passes the current token through unchanged: zeros, last tap 1."""
        weight = torch.zeros_like(self.conv1d.weight)
        weight[..., -1] = 1.0
        return weight

    @torch.no_grad()
    def reset_conv_to_identity(self) -> None:
        """Make the short conv a pass-through (last tap 1, others 0). No-op without a short conv."""
        if self.conv_kernel_size > 0:
            self.conv1d.weight.copy_(self._identity_conv_weight())

    def _delta_rule(self, query, key, value, beta, log_decay, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule over a block (shapes as `recurrent_delta_rule`) -> (output, final state). One token
        (decode) takes the recurrent step, updating `state` in place (the cache's own buffer); a short block
        without autograd (a speculative verification, a small prefill piece) the recurrent loop; longer ones the
        chunked kernel."""
        seq_len = query.shape[1]
        if seq_len == 1:
            return recurrent_delta_rule(query, key, value, beta, log_decay, initial_state=state, inplace=True)
        if seq_len <= self.SHORT_BLOCK_TOKENS and not torch.is_grad_enabled():
            return block_delta_rule(query, key, value, beta, log_decay, initial_state=state)
        return chunk_delta_rule(query, key, value, beta, log_decay, initial_state=state, chunk_size=self.chunk_size)

    def _recorded_delta_rule(self, query, key, value, beta, log_decay, state, layer
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_delta_rule` while the cache records for a rollback (docs/design.md, "Rollback"): the cache `layer`
        records the block's last `layer.max_rollback` tokens with the state before them; the tokens before those
        (a long first block, such as the prompt) run first and are not recorded."""
        head = max(query.shape[1] - layer.max_rollback, 0)
        inputs, outputs = (query, key, value, beta, log_decay), []
        if head:
            output, state = self._delta_rule(*[None if t is None else t[:, :head] for t in inputs], state)
            outputs.append(output)
        query, key, value, beta, log_decay = [None if t is None else t[:, head:] for t in inputs]
        layer.record_tokens(state, key, value, beta, log_decay, restart=head > 0)
        output, final_state = self._delta_rule(query, key, value, beta, log_decay, state)
        return (torch.cat([*outputs, output], dim=1) if outputs else output), final_state

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        documents: PackedDocuments | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, None]:
        if documents is not None:  # packed rows (no cache): each document alone, from a zero state
            return self._packed_forward(hidden_states, documents), None
        if attention_mask is None and self._steps_fast(hidden_states, cache):
            return self._inference_step(hidden_states, cache.layers[self.layer_idx]), None
        mixed_qkv, b, a, gate_input = self._project_inputs(hidden_states)
        output = self._mix(mixed_qkv, b, a, cache, attention_mask)
        return self._output(output, gate_input), None

    def _packed_forward(self, hidden_states: torch.Tensor, documents: PackedDocuments) -> torch.Tensor:
        """`forward` over packed rows: the position-wise projections on the rows as they are, the conv and the delta
        rule on a right-padded batch of one document per row (`documents.unpack`), each from an empty conv window
        and a zero state, so a document is computed as it would be alone; only those two see the padding (a row
        of short documents would otherwise run every projection over several times its own length).
        hidden_states [B, T, hidden] -> [B, T, hidden]."""
        mixed_qkv, b, a, gate_input = self._project_inputs(hidden_states)
        output = self._mix(*[None if t is None else documents.unpack(t) for t in (mixed_qkv, b, a)])
        output = documents.pack(output.flatten(-2), hidden_states)  # [documents, longest, H, V] -> [B, T, H * V]
        return self._output(output.unflatten(-1, (self.num_heads, self.value_head_dim)), gate_input)

    def _mix(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor | None, cache: Cache | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The token mixing of the reference path: short conv, q/k/v heads and their norms, beta and decay, the
        delta rule from the cached state (updating the cache). `_project_inputs`' outputs [B, T, *] -> [B, T, H, V]."""
        seq_len = mixed_qkv.shape[1]
        recurrent_state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        if attention_mask is not None:  # 2D padding mask: padded positions write nothing and decay nothing
            mixed_qkv = mixed_qkv * attention_mask[:, :, None].to(mixed_qkv.dtype)
        if self.conv_kernel_size > 0:
            mixed_qkv = self._short_conv(mixed_qkv, cache, attention_mask)
        query, key, value = mixed_qkv.split([self.key_dim, self.state_key_dim, self.state_value_dim], dim=-1)
        query = query.unflatten(-1, (self.num_heads, self.key_head_dim))  # [B, T, H, K]
        key = key.unflatten(-1, (self.num_state_heads, self.key_head_dim))  # [B, T, Hs, K]
        value = value.unflatten(-1, (self.num_state_heads, self.value_head_dim))  # [B, T, Hs, V]
        if self.config.use_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = l2_normalize(query), l2_normalize(key)

        beta = self._beta_map(b)  # [B, T, Hs]
        log_decay = self._gate_log_decay(a)  # [B, T, Hs] or [B, T, Hs, K]; None without a gate
        if attention_mask is not None:
            keep = attention_mask[:, :, None].float()
            beta = beta * keep
            if log_decay is not None:
                log_decay = log_decay * (keep[..., None] if self.gate == "channel" else keep)

        if cache is not None and cache.is_recording_past(self.layer_idx):  # a block that may be rolled back
            output, final_state = self._recorded_delta_rule(
                query, key, value, beta, log_decay, recurrent_state, cache.layers[self.layer_idx]
            )
        else:
            output, final_state = self._delta_rule(query, key, value, beta, log_decay, recurrent_state)
        if cache is not None:
            cache.update_recurrent_state(final_state, self.layer_idx, new_tokens=seq_len)
        return output

    def _output(self, output: torch.Tensor, gate_input: torch.Tensor | None) -> torch.Tensor:
        """Output norm, output gate and projection, position-wise: [B, T, H, V] -> [B, T, hidden]."""
        output = self.o_norm(output)  # [B, T, H, V]
        output = output.flatten(-2)  # [B, T, H * V]
        if gate_input is not None:
            output = output * self.gate_act(gate_input)
        return self.o_proj(output)

    def _steps_fast(self, hidden_states: torch.Tensor, cache: Cache | None) -> bool:
        """Whether this block can take `_inference_step`: at most `SHORT_BLOCK_TOKENS` new tokens (and no more than
        a recording cache can roll back), fast inference on, no autograd, CPU, and a cache entry holding a float32
        state and at least the K - 1 inputs before the block in its conv window."""
        if cache is None or not self._inference_fast() or hidden_states.device.type != "cpu":
            return False
        layer = cache.layers[self.layer_idx]
        if not isinstance(layer, DeltaLinearAttentionLayer) or not layer.has_previous_state[0]:
            return False
        seq_len = hidden_states.shape[1]
        if seq_len > self.SHORT_BLOCK_TOKENS or (layer.record_past and seq_len > layer.max_rollback):
            return False
        state = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
        if state is None or state.dtype != torch.float32 or not state.is_contiguous():
            return False
        return self.conv_kernel_size == 0 or (
            layer.is_conv_states_initialized[0] and layer.conv_states[0].shape[-1] >= self.conv_kernel_size - 1
        )

    def _inference_step(self, hidden_states: torch.Tensor, layer: DeltaLinearAttentionLayer) -> torch.Tensor:
        """`forward` for a few new tokens per row (a decode step, a speculative verification), updating the cache
        entry `layer` in place (conv window, float32 state, token count, and the record of a rollback while the
        cache records): the fast path of inference, without autograd (`_steps_fast` says when).

        The same maths as the reference path (equal to float32 rounding, tests/test_fast_decode.py) with fewer ops:
        one matmul for the inputs, the conv's outputs as weighted sums over the window, q and k normalised together
        in float32 (in 16-bit models too, where the reference normalises them in 16 bits), and the delta rule as
        one in-place step (`delta_step_inplace`, one token) or one closed-form block (`block_delta_rule`).
        hidden_states [B, T, hidden] -> [B, T, hidden]."""
        batch, seq_len, _ = hidden_states.shape
        heads, state_heads = self.num_heads, self.num_state_heads
        key_dim, value_dim = self.key_head_dim, self.value_head_dim
        mixed_qkv, b, a, gate_input = self._project_inputs(hidden_states)  # [B, T, D], [B, T, Hs], ...
        if self.conv_kernel_size > 0:
            width = self.conv_kernel_size
            # [B, D, P + T]: the cached inputs (P >= K - 1), then this block's
            window = layer.update_conv_state(mixed_qkv.transpose(1, 2), conv_kernel_size=width)
            taps = window[..., window.shape[-1] - seq_len - width + 1 :].unfold(-1, width, 1)  # [B, D, T, K]
            mixed_qkv = self.conv_act((taps * self.conv1d.weight).sum(-1)).transpose(1, 2)
        mixed_qkv = mixed_qkv.float()
        query_key = mixed_qkv[..., : self.key_dim + self.state_key_dim].unflatten(-1, (heads + state_heads, key_dim))
        if self.config.use_qk_norm:
            query_key = torch.cat([self.q_norm(query_key[:, :, :heads]), self.k_norm(query_key[:, :, heads:])], 2)
        # l2_normalize(x) = rms_norm(x, eps / K) / sqrt(K): one op for both; the queries also take the K^-0.5 scale
        query_key = F.rms_norm(query_key, (key_dim,), eps=L2_NORM_EPS / key_dim)
        query = query_key[:, :, :heads] * (1.0 / key_dim)  # [B, T, H, K]
        key = query_key[:, :, heads:] * key_dim**-0.5  # [B, T, Hs, K], unit length
        value = mixed_qkv[..., self.key_dim + self.state_key_dim :].unflatten(-1, (state_heads, value_dim))
        beta = self._beta_map(b)  # [B, T, Hs]
        log_decay = self._gate_log_decay(a)  # [B, T, Hs] or [B, T, Hs, K]
        state = layer.recurrent_states[0]  # [B, Hs, K, V] float32
        if layer.record_past:
            layer.record_tokens(state, key, value, beta, log_decay)
        if seq_len == 1:
            decay = None if log_decay is None else log_decay.exp().reshape(batch * state_heads, -1, 1)
            flat = batch * state_heads
            output = delta_step_inplace(  # the G = H / Hs queries reading each state [B * Hs, G, K]
                state.view(flat, key_dim, value_dim), query.reshape(flat, heads // state_heads, key_dim),
                key.reshape(flat, 1, key_dim), value.reshape(flat, 1, value_dim), beta.reshape(flat, 1, 1), decay)
        else:
            output, final_state = block_delta_rule(query, key, value, beta, log_decay, state, scale=1.0)
            state.copy_(final_state)
        layer.count_updated_in_place(new_tokens=seq_len)
        output = F.rms_norm(output.view(batch, seq_len, heads, value_dim), (value_dim,),
                            eps=self.o_norm.variance_epsilon)
        output = (output * self.o_norm.weight.view(heads, value_dim)).to(hidden_states.dtype)  # o_norm
        output = output.view(batch, seq_len, self.value_dim)
        if gate_input is not None:
            output = output * self.gate_act(gate_input)
        return self.o_proj(output)


class DeltaSoftmaxAttention(nn.Module):
    """Softmax attention with RoPE and GQA (Llama / Mistral / Qwen2 / Qwen3 weights fit)."""

    def __init__(self, config: DeltaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = DeltaLinear(hidden, heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = DeltaLinear(hidden, kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = DeltaLinear(hidden, kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = DeltaLinear(heads * self.head_dim, hidden, bias=config.attention_out_bias)
        if config.use_qk_norm:
            self.q_norm = DeltaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = DeltaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.config.use_qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DeltaMLP(nn.Module):
    """The gated MLP of Llama (`LlamaMLP`: same parameter names and maths), on `DeltaLinear`s."""

    def __init__(self, config: DeltaConfig):
        super().__init__()
        self.config = config
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = DeltaLinear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = DeltaLinear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = DeltaLinear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeltaDecoderLayer(GradientCheckpointingLayer):
    # an opt-in of CPU inference (`DeltaPreTrainedModel.enable_compiled_decode`): a delta layer's decode step, one new
    # token per row, runs the whole layer as one `torch.compile`d function (`compiled_step.py`) where
    # `_token_step_inputs` allows it, and the eager path otherwise
    compiled_decode = False

    def __init__(self, config: DeltaConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = DeltaAttention(config, layer_idx)
        else:
            self.self_attn = DeltaSoftmaxAttention(config, layer_idx)
        self.mlp = DeltaMLP(config)
        self.input_layernorm = DeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        documents: PackedDocuments | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        if self.compiled_decode and hidden_states.shape[1] == 1 and attention_mask is None and documents is None:
            output = self._compiled_token_step(hidden_states, cache)
            if output is not None:
                return output
        residual = hidden_states
        hidden_states = self._norm(self.input_layernorm, hidden_states)
        if self.layer_type == "linear_attention":
            hidden_states, _ = self.self_attn(
                hidden_states, attention_mask=attention_mask, cache=cache, documents=documents, **kwargs
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache,
                **kwargs,
            )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self._norm(self.post_attention_layernorm, hidden_states))
        return residual + hidden_states

    def _compiled_token_step(self, hidden_states: torch.Tensor, cache: Cache | None) -> torch.Tensor | None:
        """`forward` of a delta layer for one new token per row through the compiled `layer_token_step`, updating
        the cache entry in place; None (nothing done) where the eager path must run: not a delta layer, a step the
        fast inference path would not take (`DeltaAttention._steps_fast`), a cache recording for a rollback, a
        part of the layer the function does not know (`_token_step_inputs`), or no working compiler."""
        attention = self.self_attn
        if self.layer_type != "linear_attention" or not attention._steps_fast(hidden_states, cache):
            return None
        layer = cache.layers[attention.layer_idx]
        if layer.record_past:  # the step's inputs are recorded for a rollback (speculative decoding): eager
            return None
        conv_window = layer.conv_states[0] if attention.conv_kernel_size > 0 else None
        if conv_window is not None and conv_window.shape[-1] != attention.conv_kernel_size:
            return None
        inputs = self._token_step_inputs()
        if inputs is None:
            return None
        output = compiled_layer_token_step(hidden_states, conv_window, layer.recurrent_states[0], *inputs)
        if output is not None:
            layer.count_updated_in_place(new_tokens=1)
        return output

    def _token_step_inputs(self) -> tuple[TokenStepWeights, TokenStepSpec] | None:
        """This delta layer's tensors and spec for `layer_token_step`; None where the function would not compute
        what `forward` does: a part replaced or wrapped (PEFT, quantization), a forward hook (own or global: the
        function calls no module) or an accelerate hook on any part, input projections that cannot be fused
        (`FusedLinear`), or an activation outside `compiled_step.ACTIVATIONS`."""
        attention, mlp = self.self_attn, self.mlp
        config = attention.config
        parts = [(attention, DeltaAttention), (mlp, DeltaMLP), (attention.o_proj, DeltaLinear),
                 (attention.o_norm, DeltaHeadRMSNorm), (self.input_layernorm, DeltaRMSNorm),
                 (self.post_attention_layernorm, DeltaRMSNorm), (mlp.gate_proj, DeltaLinear),
                 (mlp.up_proj, DeltaLinear), (mlp.down_proj, DeltaLinear)]
        if attention.gate == "channel":
            parts.append((attention.a_up_proj, DeltaLinear))
        if config.use_qk_norm:
            parts += [(attention.q_norm, DeltaRMSNorm), (attention.k_norm, DeltaRMSNorm)]
        if attention.conv_kernel_size > 0:
            parts.append((attention.conv1d, nn.Conv1d))
        activations = [module for module in (getattr(attention, "conv_act", None), getattr(attention, "gate_act", None),
                                             mlp.act_fn) if isinstance(module, nn.Module)]
        if not all(type(module) is kind for module, kind in parts) or any(
            _intercepted(module) for module in [module for module, _ in parts] + activations
        ):
            return None
        conv_activation = config.linear_conv_activation or None
        gate_activation = config.linear_output_gate_activation if config.linear_output_gate else None
        if any(name is not None and name not in ACTIVATIONS for name in (conv_activation, gate_activation)) or (
            config.hidden_act not in ACTIVATIONS
        ):
            return None
        fused = attention._fused_input_projection() if attention.fuse_projections else None
        if fused is None:
            return None
        spec = TokenStepSpec(
            heads=attention.num_heads, state_heads=attention.num_state_heads, key_dim=attention.key_head_dim,
            value_dim=attention.value_head_dim, input_widths=tuple(attention.input_widths), gate=attention.gate,
            conv_activation=conv_activation, has_conv=attention.conv_kernel_size > 0, qk_norm=config.use_qk_norm,
            allow_neg_eigval=attention.allow_neg_eigval, log_decay_floor=attention.log_decay_floor,
            output_gate_activation=gate_activation, mlp_activation=config.hidden_act,
            rms_norm_eps=self.input_layernorm.variance_epsilon, l2_norm_eps=L2_NORM_EPS,
        )
        gated = attention.gate != "none"
        weights = TokenStepWeights(
            input_norm=self.input_layernorm.weight, inputs_weight=fused.weight, inputs_bias=fused.bias,
            conv_weight=attention.conv1d.weight[:, 0] if spec.has_conv else None,
            dt_bias=attention.dt_bias if gated else None, A_log=attention.A_log if gated else None,
            a_up_weight=attention.a_up_proj.weight if attention.gate == "channel" else None,
            q_norm=attention.q_norm.weight if config.use_qk_norm else None,
            k_norm=attention.k_norm.weight if config.use_qk_norm else None,
            o_norm=attention.o_norm.weight, o_weight=attention.o_proj.weight, o_bias=attention.o_proj.bias,
            post_norm=self.post_attention_layernorm.weight, gate_weight=mlp.gate_proj.weight,
            gate_bias=mlp.gate_proj.bias, up_weight=mlp.up_proj.weight, up_bias=mlp.up_proj.bias,
            down_weight=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
        )
        return weights, spec

    def _norm(self, norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        # a delta layer's fast inference path (`DeltaAttention._inference_fast`) runs the RMSNorm as one op,
        # `F.rms_norm`, equal to `LlamaRMSNorm`'s six in float32
        if self.layer_type == "linear_attention" and type(norm) is DeltaRMSNorm and self.self_attn._inference_fast():
            return F.rms_norm(hidden_states, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return norm(hidden_states)


class DeltaPreTrainedModel(PreTrainedModel):
    config: DeltaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # False although the delta layers carry a state: their cache layers roll back exactly (`crop` while recording,
    # `delta_cache.py`), which is what transformers' flag guards (it refuses assisted decoding for stateful models)
    _is_stateful = False
    _can_record_outputs = {"hidden_states": DeltaDecoderLayer, "attentions": DeltaSoftmaxAttention}

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DeltaAttention):
            if module.gate != "none":
                # decay rate A ~ U(1, 16); dt ~ logU(1e-3, 1e-1) stored as its inverse softplus (Mamba2)
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log())
                dt = torch.exp(torch.rand_like(module.dt_bias) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                               + torch.log(torch.tensor(1e-3))).clamp(min=1e-4)
                init.copy_(module.dt_bias, inverse_softplus(dt))
            if module.conv_kernel_size > 0:
                # a short conv that starts by passing the current token through unchanged
                # (`init.copy_` leaves loaded weights alone; `reset_conv_to_identity` always writes)
                init.copy_(module.conv1d.weight, module._identity_conv_weight())
        elif isinstance(module, DeltaHeadRMSNorm):
            init.ones_(module.weight)

    def pack_linear_weights(self, min_bytes: int = MIN_PACKED_BYTES) -> int:
        """For CPU inference in float32: give the linear layers whose weights have at least `min_bytes` (the MLP's and
        the LM head in SmolLM2-sized models) oneDNN's prepacked copy of their weight, which multiplies a decode
        step's or a speculative verification's few rows faster than `F.linear`. Costs a second copy of those
        weights: returns the bytes added (0, with a log line, where torch has no oneDNN). Outputs agree with the
        unpacked model to float32 rounding (`modeling/packed_linear.py`); `unpack_linear_weights` undoes it."""
        return pack_linear_weights(self, DeltaLinear, min_bytes)

    def unpack_linear_weights(self) -> None:
        """Free the copies `pack_linear_weights` made; the layers go back to their usual path."""
        unpack_linear_weights(self)

    def enable_compiled_decode(self) -> None:
        """For CPU inference: run each delta layer's decode step (one new token per row) as one function compiled by
        `torch.compile` (`modeling/compiled_step.py`), which fuses the layer's small ops between its matmuls.
        Compiled at the first decode step (6-9 s on two cores for SmolLM2's shapes) and again for another batch size
        or dtype; where inductor cannot compile, one warning and the eager path. Outputs agree with the eager path
        to float32 rounding (bf16: to bf16 rounding); steps the function does not cover (prefill, several tokens, a
        recording cache, hooks, LoRA wrappers) stay eager. `disable_compiled_decode` turns it off."""
        self._set_compiled_decode(True)

    def disable_compiled_decode(self) -> None:
        """Back to the eager decode step (`enable_compiled_decode` undone)."""
        self._set_compiled_decode(False)

    def _set_compiled_decode(self, enabled: bool) -> None:
        for module in self.modules():
            if isinstance(module, DeltaDecoderLayer):
                module.compiled_decode = enabled


class DeltaModel(DeltaPreTrainedModel):
    def __init__(self, config: DeltaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeltaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def _check_cache(self, cache: Cache) -> None:
        """Refuse a cache built for other layer types; give its delta layers the token count (`use_delta_layers`)."""
        layers = getattr(cache, "layers", None)
        ok = layers is not None and len(layers) == self.config.num_hidden_layers and all(
            isinstance(layer, LinearAttentionCacheLayerMixin) == (kind == "linear_attention")
            for layer, kind in zip(layers, self.config.layer_types)
        )
        if not ok:
            raise ValueError(
                "The cache does not match this model's layer types; build it with `DynamicCache(config=model.config)` "
                "or `StaticCache(config=model.config, max_cache_len=...)`, or let the model create it (`use_cache=True`)."
            )
        use_delta_layers(cache)

    @staticmethod
    def _packed_documents(position_ids, attention_mask, cache, batch) -> PackedDocuments | None:
        """The documents of packed rows: position ids restarting inside a row, with no attention mask (what
        transformers' masks read as packed sequences too, `find_packed_sequence_indices`). None when not packed."""
        if position_ids is None or attention_mask is not None or position_ids.shape[-1] < 2:
            return None
        document_ids = find_packed_sequence_indices(position_ids.expand(batch, -1))
        if document_ids is None or not bool(document_ids[:, -1].any()):
            return None
        if cache is not None:
            raise ValueError(
                "position_ids restart inside a row (packed documents), which is supported only in a forward without a "
                "cache (training); pass one document per row, or call the model without `cache`."
            )
        return PackedDocuments(document_ids)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        documents = self._packed_documents(position_ids, attention_mask, cache, inputs_embeds.shape[0])
        if documents is not None:
            use_cache = False  # a packed batch is training input: there is no one past to continue
        if use_cache and cache is None:
            cache = DeltaCache(config=self.config)
        if cache is not None:
            self._check_cache(cache)

        past_length = cached_length(cache)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length
            position_ids = position_ids.unsqueeze(0)

        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            mask_mapping = {kind: MASK_FUNCTIONS[kind](**mask_kwargs) for kind in set(self.config.layer_types)}

        hidden_states = inputs_embeds
        position_embeddings = None
        if any(kind != "linear_attention" for kind in self.config.layer_types):
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=mask_mapping[decoder_layer.layer_type],
                cache=cache,
                documents=documents,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class DeltaForCausalLM(DeltaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    # `generate` prefills prompts longer than this many new tokens through `prefill`, in pieces of this size (0:
    # never); 4096 measured as fast as 8192 or faster (a smaller working set) with half the peak memory
    prefill_piece_size = 4096

    def __init__(self, config: DeltaConfig):
        super().__init__(config)
        self.model = DeltaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = DeltaLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        *,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        piece_size: int = 4096,
        logits_to_keep: int | torch.Tensor = 1,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """Run a prompt into `cache` `piece_size` tokens at a time: memory independent of the prompt's length.

        Each piece continues from the cache the previous one filled, and only the hidden states of the positions
        `logits_to_keep` selects are kept (an int keeps the last ones, 0 all of them; a 1D tensor the given
        positions). For an all-delta model the peak memory then depends on `piece_size` alone (a hybrid's softmax
        layers still grow their KV cache). Equal to one `forward` call with the same arguments, without
        gradients: returns the logits and the filled cache (a new `DeltaCache` when `cache` is None).
        `attention_mask` (2D) covers the cached tokens too, as in `generate`; `position_ids` [B, T] only the new ones.

        On CPU, freed heap pages go back to the OS after every piece (`release_freed_memory`): without that the
        process's resident size creeps up over hundreds of pieces although no tensor grows.
        """
        tokens = input_ids if input_ids is not None else inputs_embeds
        seq_len = tokens.shape[1]
        cache = DeltaCache(config=self.config) if cache is None else cache
        mask_offset = attention_mask.shape[1] - seq_len if attention_mask is not None else 0
        kept = KeptHidden(logits_to_keep, seq_len, tokens.device)
        for start in range(0, seq_len, piece_size):
            end = min(start + piece_size, seq_len)
            hidden = self.model(
                input_ids=input_ids[:, start:end] if input_ids is not None else None,
                inputs_embeds=inputs_embeds[:, start:end] if inputs_embeds is not None else None,
                attention_mask=attention_mask[:, : mask_offset + end] if attention_mask is not None else None,
                position_ids=position_ids[:, start:end] if position_ids is not None else None,
                cache=cache,
                use_cache=True,
                **kwargs,
            ).last_hidden_state  # [B, end - start, hidden]
            kept.add(hidden, start)
            del hidden
            if tokens.device.type == "cpu":
                release_freed_memory()
        return CausalLMOutputWithPast(logits=self.lm_head(kept.result()), cache=cache)

    def _uncached_start(self, input_ids, cache, attention_mask=None, position_ids=None) -> int:
        """Index in `input_ids` of the first token `cache` lacks. `generate` may get the whole sequence so far (as
        long as its mask and position ids, which cover the cached tokens too) or only the new tokens."""
        past = cached_length(cache)
        if not past or input_ids.shape[1] <= past:
            return 0
        whole = next((t.shape[-1] for t in (attention_mask, position_ids) if t is not None), input_ids.shape[1])
        return past if input_ids.shape[1] == whole else 0

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # `generate` builds a `DynamicCache`; ours counts the tokens of delta layers (`get_seq_length` works)
        given = model_kwargs.get("cache")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        built = model_kwargs.get("cache")
        if given is None and type(built) is DynamicCache:
            config = self.config.get_text_config(decoder=True)
            # room to roll back the longest draft this call may verify (assisted and prompt-lookup decoding)
            drafts = (generation_config.prompt_lookup_num_tokens, generation_config.num_assistant_tokens,
                      generation_config.max_new_tokens if generation_config.is_assistant else None)
            max_rollback = max([DEFAULT_MAX_ROLLBACK] + [int(n) for n in drafts if n])
            cache = DeltaCache(config=config, offloading=built.offloading, max_rollback=max_rollback)
            if any(getattr(layer, "record_past", False) for layer in built.layers):  # an assistant's cache
                cache.activate_past_recording()
            model_kwargs["cache"] = cache

    def _assisted_decoding(self, input_ids, *args, inputs_tensor=None, **model_kwargs):
        """transformers' assisted and prompt-lookup decoding, unchanged: verifying a draft runs it through the
        model while the cache records, and `cache.crop` rolls the delta states back past the rejected tokens
        (`delta_cache.py`). The cache handed back afterwards no longer records (plain decoding then costs nothing
        more)."""
        try:
            return super()._assisted_decoding(input_ids, *args, inputs_tensor=inputs_tensor, **model_kwargs)
        finally:
            if model_kwargs.get("cache") is not None:
                stop_recording(model_kwargs["cache"])

    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        """`generate`'s prefill step. Of more than `prefill_piece_size` new prompt tokens, all but the last piece go
        through `prefill` first (memory independent of the prompt's length); transformers' own step then runs the
        last piece and gives the first logits. Left to transformers: an explicit `prefill_chunk_size`, prompts
        given as embeddings, and calls asking for hidden states or attentions (they would cover the last piece only).
        """
        cache, piece = model_kwargs.get("cache"), self.prefill_piece_size
        plain = not any(model_kwargs.get(key) is not None for key in ("inputs_embeds", "output_hidden_states",
                                                                      "output_attentions"))
        if piece and cache is not None and plain and generation_config.prefill_chunk_size is None:
            mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
            past = cached_length(cache)
            new_ids = input_ids[:, self._uncached_start(input_ids, cache, mask, positions) :]
            head = (new_ids.shape[1] - 1) // piece * piece
            if head > 0:
                end = past + head  # in positions of the whole sequence, cached tokens included
                self.prefill(
                    new_ids[:, :head],
                    cache=cache,
                    attention_mask=mask[:, :end] if mask is not None else None,
                    position_ids=positions[..., past:end] if positions is not None else None,
                    piece_size=piece,
                )
                input_ids = new_ids[:, head:]
        return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, **kwargs):
        # `generate` slices already-cached tokens off a continued prompt using `get_seq_length`, which it does not
        # call on an all-delta cache; do the same slicing with our own count.
        if next_sequence_length is None and cache is not None and all(cache.is_linear):
            start = self._uncached_start(input_ids, cache, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            if start:
                next_sequence_length = input_ids.shape[1] - start
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, **kwargs
        )


DeltaModel.register_for_auto_class("AutoModel")
DeltaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["DeltaForCausalLM", "DeltaModel", "DeltaPreTrainedModel"]
