"""A Llama causal decoder (`taktiny.models.Decoder`), loaded from Hugging Face's `LlamaForCausalLM`.

The reference is a small random `transformers.LlamaForCausalLM` (nothing is downloaded):
RMSNorm, rotary position embeddings, grouped-query attention without biases (2 key/value
heads for 4 query heads) and a SwiGLU MLP. It runs twice: as Llama 2, with the output
projection tied to the token embedding (`Embed.attend`, a `convert.Tie`), and as Llama 3.1,
with its own `lm_head` and rotary embeddings scaled the "llama3" way (`rope_scaling`). The
rules (`models.rules`) load the folder `save_pretrained` writes (checked name by name,
loaded strictly into a model built without initialising it; a tied model's file has no
`lm_head.weight`) and
exports the model back into a folder that `LlamaForCausalLM.from_pretrained` loads with no
missing or unexpected names; `convert.parity` compares the logits both times, at full
float32 matmul precision. Then it decodes greedily with a `KVCache` per layer: the prompt in
one jitted call, each new token through one jitted step that compiles once, and compares the
tokens with `generate`. A third run scans the Llama 2 model: its decoder layers are one
`nn.Stack` (each parameter [layers, ...], run by `jax.lax.scan`, so jit compiles one layer
whatever the depth), loaded from the same folder with the same rules (each layer's tensors
stream into their slices of the stacked arrays), exported back the same way, and decoding
with one KVCache stacked over the layers. Last, quantized checkpoints as models ship:
the Llama 3.1 model saved in FP8 blocks (float8 weights, a float32 scale per 128x128 block,
`quantization_config` in config.json) loads through `convert.quantized_rules`, checked against
transformers holding the weights PyTorch's DCP reader dequantizes; its int4 model exports as
compressed-tensors, which `from_pretrained` decompresses to exactly its weights, and loads back
bit for bit. Run `python examples/llama.py`: it prints the largest differences in the logits
and both models' tokens.
"""

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from transformers import LlamaConfig, LlamaForCausalLM

import taktiny as tt
from taktiny import convert, models, nn
from taktiny.io import load_safetensors, open_safetensors, save_safetensors


def Llama(config: LlamaConfig, *, rngs: nn.Rngs, scanned: bool = False) -> models.Decoder:
    """The Llama of `config` (transformers' own config object), from `taktiny.models`: token
    ids [batch, length] -> next-token logits; with `caches` (from `init_caches`), the caches
    advanced too. `scanned=True` holds the decoder layers as one `nn.Stack` run by
    `jax.lax.scan`; its per-layer names are those of the list of layers, so the same rules
    load and export both."""
    return models.Decoder(config.to_dict(), scanned=scanned, rngs=rngs)


def rules_for(tied: bool) -> list[Any]:
    """Hugging Face name <-> Taktiny name, from `taktiny.models.rules`: every projection a
    bias-free `nn.Linear` (weight [out, in], transposed), the RMSNorms a weight only; tied,
    `lm_head.weight` is the token embedding itself (a `convert.Tie`: both checked equal
    where a file holds both, and only the embedding exported, as save_pretrained writes
    it); `convert.buffers()` drops the rotary `inv_freq` that older files hold."""
    return models.rules(models.DecoderConfig.from_hf(llama_config(tied).to_dict()))


def llama_config(tied: bool) -> LlamaConfig:
    """The small random model: 2 layers, 4 query heads sharing 2 key/value heads. Tied, as
    Llama 2 with plain rotary embeddings; untied, as Llama 3.1: theta 500000 and "llama3"
    scaling (here from a trained context of 32 positions, so that it changes the angles of
    these short sequences)."""
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}  # fmt: skip
    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0} if tied else llama3,
        max_position_embeddings=128, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # generate never stops early
    )  # fmt: skip


TIED_RULES, UNTIED_RULES = rules_for(tied=True), rules_for(tied=False)


def hugging_face(config: LlamaConfig) -> LlamaForCausalLM:
    """The reference, for inference, its attention written out: the plainest reference."""
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def randomized(config: LlamaConfig) -> LlamaForCausalLM:
    """The reference of `config`, every parameter moved off its init (RMSNorm weights are
    ones; a tied embedding appears once)."""
    torch.manual_seed(0)
    reference = hugging_face(config)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return reference


def greedy(model: models.Decoder, prompt: np.ndarray, new_tokens: int) -> tuple[np.ndarray, int]:
    """`new_tokens` tokens decoded greedily after `prompt` [batch, length], and how many
    times the one-token step was traced (compiled)."""
    traces = 0

    @jax.jit
    def step(model, token, caches):  # token [batch, 1] -> the next one, and the caches
        nonlocal traces
        traces += 1  # runs only when jax.jit traces: once per input shape
        logits, caches = model(token, caches=caches)
        return jnp.argmax(logits[:, -1], axis=-1, keepdims=True), caches

    batch, length = prompt.shape
    caches = model.init_caches(batch, length + new_tokens)
    prefill = jax.jit(lambda model, ids, caches: model(ids, caches=caches))
    logits, caches = prefill(model, prompt, caches)  # the whole prompt in one call
    tokens = [jnp.argmax(logits[:, -1], axis=-1, keepdims=True)]
    for _ in range(new_tokens - 1):  # the last token is never fed back
        token, caches = step(model, tokens[-1], caches)
        tokens.append(token)
    return np.asarray(jnp.concatenate(tokens, axis=1)), traces


def compare(tied: bool, scanned: bool = False):
    """Converts, checks and exports the model with a tied or an untied head (scanned: its
    layers one `nn.Stack`), then decodes."""
    head, rules = ("tied", TIED_RULES) if tied else ("untied", UNTIED_RULES)
    head += ", scanned" if scanned else ""
    config = llama_config(tied)
    reference = randomized(config)

    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)  # the files people download
        # no initialisation; scanned, each layer's tensors stream into their slices
        abstract = jax.eval_shape(lambda: Llama(config, rngs=nn.Rngs(0), scanned=scanned))
        # every name checked (used once, every leaf made, shapes right) before anything loads
        model = load_safetensors(abstract, folder, rules=rules)

    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    forward = jax.jit(lambda model, ids: model(ids))
    ours = lambda ids: forward(model, ids)
    # without the cache, a LlamaForCausalLM's output holds the logits only: named "logits"
    theirs = lambda torch_model: lambda ids: torch_model(torch.from_numpy(ids), use_cache=False)
    # full float32 matmuls: a GPU would otherwise default to TF32
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print(f"Taktiny against transformers ({head}):")
        print(convert.parity(ours, theirs(reference), ids, tolerance=1e-4))

        # and back: torch's [out, in] weights, into a folder from_pretrained reads
        with tempfile.TemporaryDirectory() as folder:
            save_safetensors(Path(folder) / "model.safetensors", convert.export(rules, model))
            config.save_pretrained(folder)
            fresh, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mis-shaped names
        fresh.eval().set_attn_implementation("eager")
        print(f"exported back through save_safetensors into from_pretrained ({head}):")
        print(convert.parity(ours, theirs(fresh), ids, tolerance=1e-4))

        prompt, new = ids[:, :7], 20
        tokens, traces = greedy(model, prompt, new)
        generated = reference.generate(  # pyright: ignore[reportAttributeAccessIssue]
            torch.from_numpy(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
        )[:, prompt.shape[1] :].numpy()
    print(f"greedy decoding ({head}), {new} tokens after a prompt of {prompt.shape[1]}:")
    print(f"  Taktiny:  {tokens.tolist()}")
    print(f"  generate: {generated.tolist()}")
    print(f"  equal: {np.array_equal(tokens, generated)}")
    print(f"  one-token step traced {traces} time(s) for {new - 1} steps")


def fp8_checkpoint(reference: LlamaForCausalLM, folder: str, block: int = 128) -> None:
    """Saves `reference` as the FP8 releases on the Hub are saved: each decoder projection's
    weight in float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block (the
    block's largest magnitude / 448; the last block of an axis holds what is left), the
    rest as it is, in one shard with its index, and `quantization_config` in config.json."""
    tensors = {}
    for name, w in reference.state_dict().items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = w.contiguous()
            continue
        rows, cols = (-(-n // block) for n in w.shape)
        padded = torch.zeros(rows * block, cols * block)
        padded[: w.shape[0], : w.shape[1]] = w
        scale = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        tensors[name] = (w / full[: w.shape[0], : w.shape[1]]).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    shard = "model-00001-of-00001.safetensors"  # one shard and its index, as DCP reads them
    save_file(tensors, Path(folder) / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, shard)}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index))
    reference.config.quantization_config = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }  # fmt: skip
    reference.config.save_pretrained(folder)
    del reference.config.quantization_config


def quantized():
    """The Llama 3.1 model from an FP8 block-scaled checkpoint, against transformers holding
    the weights PyTorch's DCP reader dequantizes from it; then quantized to int4 (in groups of
    16) and exported as compressed-tensors, against transformers decompressing it, and
    loaded back."""
    config = llama_config(tied=False)
    reference = randomized(config)
    abstract = jax.eval_shape(lambda: Llama(config, rngs=nn.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    theirs = lambda torch_model: lambda ids: torch_model(torch.from_numpy(ids), use_cache=False)
    with tempfile.TemporaryDirectory() as folder:
        fp8_checkpoint(reference, folder)
        checkpoint = open_safetensors(folder)
        # each projection's rule now reads its weight and scales, dequantized in blocks
        model = load_safetensors(
            abstract, checkpoint, rules=convert.quantized_rules(UNTIED_RULES, checkpoint)
        )
        dequantized = {n: torch.empty_like(p) for n, p in reference.state_dict().items()}
        with warnings.catch_warnings():  # (DCP says it reads in this one process)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                dequantized, storage_reader=QuantizedHuggingFaceStorageReader(folder), no_dist=True
            )
    dcp_model = hugging_face(config)
    dcp_model.load_state_dict(dequantized)
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print("FP8 blocks: Taktiny against transformers with DCP's dequantized weights:")
        print(convert.parity(lambda ids: model(ids), theirs(dcp_model), ids, tolerance=1e-4))

    # int4 in groups of 16 for every Linear (transformers cannot build a quantized Embedding)
    linear = lambda name, layer: isinstance(layer, nn.Linear)
    int4 = tt.quantize(model, bits=4, group_size=16, where=linear)
    with tempfile.TemporaryDirectory() as folder:
        tensors, quantization = convert.export_compressed_tensors(UNTIED_RULES, int4)
        save_safetensors(Path(folder) / "model.safetensors", tensors)
        config.quantization_config = quantization
        config.save_pretrained(folder)
        del config.quantization_config
        served = hugging_face_from(folder)  # decompressed by compressed_tensors
        checkpoint = open_safetensors(folder)
        target = tt.quantize(abstract, bits=4, group_size=16, where=linear)
        back = load_safetensors(
            target, checkpoint, rules=convert.quantized_rules(UNTIED_RULES, checkpoint)
        )
    with torch.no_grad(), jax.default_matmul_precision("highest"):
        print("int4 exported as compressed-tensors, against transformers loading it:")
        print(convert.parity(jax.jit(lambda ids: int4(ids)), theirs(served), ids, tolerance=1e-5))
    same = all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(int4), strict=True)
    )
    print(f"int4 loaded back from compressed-tensors, bit for bit: {same}")


def hugging_face_from(folder: str) -> LlamaForCausalLM:
    """`from_pretrained` of `folder`, for inference with its attention written out."""
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    model.set_attn_implementation("eager")
    return model


def main():
    compare(tied=True)
    compare(tied=False)
    compare(tied=True, scanned=True)
    quantized()


if __name__ == "__main__":
    main()
