"""A megatron-core GPTModel for a DecoderConfig: the local layer spec (Transformer Engine on GPUs where
installed), configured to compute what our decoder (models/decoder.py) computes.

What Megatron's GPTModel cannot express of a family is refused in one line (`megatron_problems`):
RoPE scaling, sliding windows and a bias on o_proj without one on the MLP (Megatron's
`add_bias_linear` puts a bias on every linear layer; `add_qkv_bias` on q, k, v alone).
The scalar head (critic, reward) replaces the LM head: `ScalarHead`, hidden -> 1 with a bias,
replicated over tensor parallelism.

A MoE model (Mixtral) gets Megatron's MoE layer with its local experts (SequentialMLP), routed as
transformers routes (softmax over the top-k logits = the renormalised top-k probabilities, in fp32,
no load-balancing loss), the experts split over `ep` ranks and whole on each (expert tensor parallel
size 1). Tokens reach their experts through the all-to-all dispatcher on GPUs; on CPU through the
all-gather one, as the all-to-all dispatcher makes CUDA streams when it is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig, Head


def megatron_problems(cfg: DecoderConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> list[str]:
    """What keeps this model from Megatron's GPTModel at (tp, pp, ep); [] when it runs."""
    problems = []
    if ep > 1 and (cfg.num_local_experts or 1) % ep:
        problems.append(f"ep={ep} must divide the experts per layer ({cfg.num_local_experts or 'a dense model'})")
    if cfg.rope_scaling.rope_type != "default":
        problems.append(f"RoPE scaling '{cfg.rope_scaling.rope_type}' is not supported by the megatron backend")
    if cfg.sliding_window is not None:
        problems.append("a sliding attention window is not supported by the megatron backend")
    if (cfg.o_bias or cfg.mlp_bias) and not (cfg.o_bias and cfg.mlp_bias and cfg.qkv_bias):
        problems.append("biases on o_proj or the MLP need biases on every linear layer under the megatron backend")
    if cfg.num_key_value_heads % tp or cfg.num_attention_heads % tp:
        problems.append(f"tp={tp} must divide the {cfg.num_key_value_heads} kv heads")
    if cfg.vocab_size % tp:
        problems.append(f"tp={tp} must divide the vocabulary ({cfg.vocab_size})")
    if cfg.num_hidden_layers % pp:
        problems.append(f"pp={pp} must divide the {cfg.num_hidden_layers} layers")
    return problems


def check_megatron(cfg: DecoderConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    problems = megatron_problems(cfg, tp, pp, ep)
    if problems:
        raise HflowError(f"{problems[0]}; use train.backend: fsdp for this model")


def _moe_options(cfg: DecoderConfig, ep: int) -> dict:
    if not cfg.is_moe:
        return {}
    return dict(num_moe_experts=cfg.num_local_experts, moe_router_topk=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.intermediate_size, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
                expert_model_parallel_size=ep, expert_tensor_parallel_size=1)


def _define_te_general_gemm() -> None:
    """megatron-core 0.16 leaves `moe_utils.te_general_gemm` undefined when Transformer Engine is not
    installed, and its router then fails with a NameError; None is what it checks for."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(cfg: DecoderConfig, tp: int, pp: int, dtype: torch.dtype = torch.float32, ep: int = 1):
    from megatron.core.transformer import TransformerConfig

    all_bias = cfg.o_bias and cfg.mlp_bias
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.dim_head, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=all_bias, add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not torch.cuda.is_available(),
        # perform_initialization stays on though the weights come from an HF folder: megatron marks a
        # parameter tensor-parallel (which the grad norm counts once per shard) only while initialising it.
        # Fused kernels are CUDA-only; the unfused paths compute the same.
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # fp32 softmax and residuals, as our decoder and HF compute them
        attention_softmax_in_fp32=True, fp32_residual_connection=False, **_moe_options(cfg, ep),
    )


class ScalarHead(nn.Module):
    """hidden -> 1 with a bias, in GPTModel's output-layer slot (called as output_layer(h, weight=...))."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(hidden, self.weight, self.bias), None


def build_stage(cfg: DecoderConfig, head: Head, tp: int, pp: int, pp_rank: int,
                dtype: torch.dtype = torch.float32, ep: int = 1) -> nn.Module:
    """This pipeline stage's GPTModel (layers numbered from 0 within the stage), uninitialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(cfg.num_local_experts, qk_layernorm=cfg.qk_norm)
    except ImportError:
        _define_te_general_gemm()
        spec = get_gpt_layer_local_spec(cfg.num_local_experts, qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    post = pp_rank == pp - 1
    model = GPTModel(transformer_config(cfg, tp, pp, dtype, ep), spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=pp_rank == 0, post_process=post,
                     parallel_output=False,  # whole-vocabulary logits: log-probs as our decoder computes them
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings and head == "lm",
                     position_embedding_type="rope", rotary_base=cfg.rope_theta, rotary_percent=1.0)
    if head == "scalar" and post:
        model.output_layer = ScalarHead(cfg.hidden_size, dtype)
    return model
