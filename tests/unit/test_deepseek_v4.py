"""The `deepseek_v4` family against transformers' `DeepseekV4ForCausalLM` through an HF folder
on disk: logits, loss and every gradient (fp32), the folder written back, and the layouts and
inputs the family refuses.

The tiny model has one layer of each attention type (sliding, CSA, HCA) over 40 tokens with
a window of 8: CSA keeps 3 of up to 10 entries of 4 tokens, HCA reads 5 entries of 8, and the
first layer routes by token id, the others by top-k.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import check_round_trip, earliest_first_topk, max_rel_err
from transformers import AutoModelForCausalLM, DeepseekV4Config, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from temper.config import Parallelism
from temper.generation import generate
from temper.kernels.attention import DocumentMask
from temper.models import build_model, get_model_spec, load_hf
from temper.models.deepseek_v4 import DeepseekV4Transformer
from temper.models.hf import adapter_of
from temper.models.layers.routers import HashRouter

SEQ = 40
CONFIG = DeepseekV4Config(
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    partial_rotary_factor=0.5,
    q_lora_rank=12,
    n_routed_experts=4,
    num_experts_per_tok=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    hc_mult=2,
    hc_sinkhorn_iters=3,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=8,  # few entries score 0 (relu) alike, where top-k would break ties
    index_head_dim=12,
    index_topk=3,
    swiglu_limit=0.5,  # low enough that the clamps act on these activations
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    bos_token_id=None,
    eos_token_id=None,
)


@pytest.fixture(autouse=True)
def _ties_decided_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers selects with ``topk``, whose order among equal scores is unspecified:
    here it decides ties as ``select_top_k`` does (``earliest_first_topk``)."""
    monkeypatch.setattr(torch.Tensor, "topk", earliest_first_topk)


def tiny_hf(folder: Path) -> PreTrainedModel:
    """A seeded random V4 saved to ``folder``: transformers' init leaves sinks, position biases,
    hyper-connection biases and the hash table at zero and norms at one; all get random values
    here, the routers a decisive gate and a random balancing bias."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "position_bias", "base", "mlp.gate.weight", "fn")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
            elif name.endswith("tid2eid"):
                buffer.copy_(torch.rand(64, 4).argsort(dim=-1)[:, :2])
    model.save_pretrained(folder)
    return model.eval()


def test_matches_transformers_logits_loss_and_every_gradient(tmp_path: Path) -> None:
    hf_model = tiny_hf(tmp_path / "hf")
    native = load_hf(tmp_path / "hf").eval()
    assert isinstance(native, DeepseekV4Transformer)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    hf_out = hf_model(ids, labels=ids)
    logits = native(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert max_rel_err(logits.detach(), hf_out.logits.detach()) < 1e-5
    assert abs(loss.item() - hf_out.loss.item()) < 1e-6 * hf_out.loss.item()
    hf_out.loss.backward()
    loss.backward()
    # transformers' own renaming from its modules to the checkpoint names.
    hf_grads = revert_weight_conversion(
        hf_model, {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    )
    params = dict(native.named_parameters())
    for rule in adapter_of(native).key_rules(native.args):
        got = params[rule.native].grad
        if rule.hf[0] not in hf_grads:
            # The indexer chooses without gradient, there as here.
            assert got is None and ".indexer." in rule.native, rule.native
            continue
        expected = torch.stack([hf_grads[k] for k in rule.hf]).view_as(got)
        assert max_rel_err(got, expected) < 1e-5, rule.native


def test_the_choices_matter_at_this_length(tmp_path: Path) -> None:
    """Dropping the indexer's choice (every entry) or the hash table (another one) changes the
    logits: the parity above is over sequences where both decide."""
    tiny_hf(tmp_path / "hf")
    native = load_hf(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = native(ids)
        native.layers[1].attention.indexer.topk = SEQ
        assert not torch.allclose(native(ids), reference)
        native.layers[1].attention.indexer.topk = 3
        router = native.layers[0].feed_forward.router
        assert isinstance(router, HashRouter)
        router.tid2eid.copy_(router.tid2eid.roll(1, dims=0))
        assert not torch.allclose(native(ids), reference)


def test_packed_rows_equal_each_document_alone(tmp_path: Path) -> None:
    """Documents of 23 and 17 tokens packed in one row (positions restarting) give the logits
    each gives alone: windows, entries, sliding window and hash routing stay per document."""
    tiny_hf(tmp_path / "hf")
    native = load_hf(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.cat((torch.arange(23), torch.arange(17)))[None]
    with torch.no_grad():
        packed = native(ids, positions, DocumentMask.from_position_ids(positions))
        alone = torch.cat((native(ids[:, :23]), native(ids[:, 23:])), dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_greedy_generation_equals_transformers(tmp_path: Path) -> None:
    """Left-padded prompts decoded together with Temper's KV cache, 16 tokens past prompts of
    9 and 3 (so windows close and the indexer's top 3 of up to 6 entries binds while
    decoding): transformers' greedy generate of each prompt alone, with its V4 caches."""
    hf_model = tiny_hf(tmp_path / "hf")
    native = load_hf(tmp_path / "hf")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16]]
    new = 16
    with torch.no_grad():
        theirs = [
            hf_model.generate(
                torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    ours = generate(native, prompts, new, pad_id=0)
    assert ours.tokens.tolist() == theirs


def test_folder_round_trips_and_transformers_loads_the_export(tmp_path: Path) -> None:
    hf_model = tiny_hf(tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf_model)


def test_checkpoint_export_carries_the_mtp_tensors(tmp_path: Path) -> None:
    """A released-style folder with ``mtp.*`` tensors (not modelled) -> DCP checkpoint -> HF
    export: they arrive untouched, and transformers loads the export with the folder's
    logits."""
    from safetensors.torch import load_file, save_file

    from temper.checkpoint.convert import dcp_to_hf, hf_to_dcp

    hf_model = tiny_hf(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    mtp = {"mtp.0.eh_proj.weight": torch.randn(32, 64), "mtp.0.enorm.weight": torch.rand(32)}
    save_file(load_file(weights) | mtp, weights, metadata={"format": "pt"})
    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    dcp_to_hf(tmp_path / "ckpt", tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in mtp.items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 64, (1, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits, rtol=0, atol=0)


def test_debug_flavor_trains_a_step_and_refuses_what_it_lacks() -> None:
    torch.manual_seed(0)
    model = build_model("deepseek_v4", "debug", device="cpu")
    args = model.args
    assert set(args.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(args.mlp_layer_types) == {"hash_moe", "moe"}
    ids = torch.randint(0, args.vocab_size, (1, 48))
    logits = model(ids)
    F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".indexer." not in n)
    spec = get_model_spec("deepseek_v4")
    for parallelism in (Parallelism(ep=2, sp=2), Parallelism(cp=2), Parallelism(cp=2, sp=2)):
        spec.check_layout(args, parallelism)  # CP's parity: test_dsa_context_parallel
