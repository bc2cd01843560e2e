"""Model-folder tokenizers: a BPE tokenizer with a chat template (tokenizers library, saved as transformers
does) next to a tiny HF Llama encodes prompts exactly as transformers does, left-padded; EOS and pad ids
come from the folder; several EOS ids stop generation; the character tokenizer stays for the built-in
model and the warm-up refuses any other vocabulary."""

import json

import pytest
import torch
from hf_util import build_hf_folder, build_tokenizer

from hybridflow.runtime.tasks.model_tokenizer import HFTokenizer, load_tokenizer
from hybridflow.runtime.tasks.tokenizer import CharTokenizer
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset

pytest.importorskip("transformers")

TEXTS = ["what is 3 plus 4?", "what is 12 plus 19? tell me", "what"]
CHATS = [[{"role": "user", "content": "what is 3 plus 4?"}],
         [{"role": "system", "content": "answer with a number"}, {"role": "user", "content": "what is 12 plus 19?"}]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_hf_folder(tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own tokenizer of the folder, padding on the left."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ref.padding_side = "left"
    return ref


def test_text_and_chat_prompts_encode_left_padded_as_transformers_does(folder, reference):
    tok = load_tokenizer(folder, model_vocab=ModelSpec.from_hf_config(folder).vocab)
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    ids, mask = tok.encode_prompts(TEXTS)
    want = reference(TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(ids, want["input_ids"]) and torch.equal(mask, want["attention_mask"])
    first = ids[torch.arange(len(TEXTS)), (mask == 0).sum(1)]
    assert (first == reference.bos_token_id).all()  # BOS from the tokenizer's own post-processor
    ids, mask = tok.encode_prompts(CHATS)
    want = reference.apply_chat_template(CHATS, add_generation_prompt=True, padding=True, return_tensors="pt",
                                         return_dict=True)
    assert torch.equal(ids, want["input_ids"]) and torch.equal(mask, want["attention_mask"])
    assert reference.decode(ids[0][mask[0].bool()]).endswith("<|im_start|>assistant\n")  # generation prompt
    # plain text through the template when the run asks for it: one user message
    ids, _ = tok.encode_prompts(TEXTS[:1], chat=True)
    assert ids[0].tolist() == reference.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                                            add_generation_prompt=True, return_dict=True)["input_ids"]
    with pytest.raises(HflowError, match=r"a prompt has \d+ tokens but prompt_len is 4 \('what is 12 plus"):
        tok.encode_prompts(TEXTS[1:], max_len=4)


def test_eos_and_pad_ids_come_from_the_folder(folder, tmp_path):
    tok = load_tokenizer(folder)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_ids == [tok.hf.eos_token_id, im_end]  # generation_config's list; the tokenizer's own deduplicated
    assert tok.pad_id == tok.hf.pad_token_id == 0
    # no generation_config, no pad token: the tokenizer's EOS stops, and pads
    build_tokenizer(tmp_path, pad=False)
    bare = load_tokenizer(tmp_path)
    assert bare.eos_ids == [2] and bare.pad_id == 2
    ids, mask = bare.encode_prompts(TEXTS[:2])
    assert (ids[mask == 0] == 2).all()


def test_decoding_drops_special_tokens_and_stops_at_any_eos(folder):
    tok = load_tokenizer(folder)
    words = tok.hf("the answer is 7.", add_special_tokens=False)["input_ids"]
    eos, im_end = tok.eos_ids
    rows = torch.tensor([words + [im_end] + words, [tok.hf.bos_token_id] + words + [eos] + [0] * (len(words) - 1)])
    assert tok.decode_responses(rows) == ["the answer is 7.", "the answer is 7."]
    mask = torch.ones_like(rows)
    mask[0, 2:] = 0  # the response mask cuts too
    assert tok.decode_responses(rows, mask)[0] == tok.hf.decode(words[:2])


def test_several_eos_ids_stop_generation(folder):
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams
    from hybridflow.runtime.models.hf_format import load_pretrained

    model = load_pretrained(folder).eval()
    tok = load_tokenizer(folder)
    ids, mask = tok.encode_prompts(CHATS)
    free = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=12, greedy=True))
    # two stop tokens: what row 0 emits 3rd and what row 1 emits 5th (greedy, so the same tokens again)
    stops = [free.response[0, 2].item(), free.response[1, 4].item()]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "pad_token_id": 0}))
    tok = load_tokenizer(folder)
    assert stops[0] in tok.eos_ids and stops[1] in tok.eos_ids
    out = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=12, greedy=True,
                                                                     eos_token_id=tok.eos_ids, pad_token_id=tok.pad_id))
    for row in range(2):
        hits = [t for t, tid in enumerate(free.response[row].tolist()) if tid in tok.eos_ids]
        assert out.response_mask[row].sum().item() == hits[0] + 1  # up to and including the first EOS of any kind
        assert torch.equal(out.response[row, :hits[0] + 1], free.response[row, :hits[0] + 1])


def test_tokenizer_bigger_than_the_embedding_is_one_line(folder, tmp_path):
    with pytest.raises(HflowError, match=r"the tokenizer has 320 tokens but the model's embedding has 64 rows") as e:
        load_tokenizer(folder, model_vocab=64)
    assert "\n" not in str(e.value)
    with pytest.raises(HflowError, match="no tokenizer here"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(HflowError, match="transformers cannot load its tokenizer") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


def test_chat_prompts_need_a_chat_template(tmp_path):
    build_tokenizer(tmp_path, chat_template=False)
    tok = load_tokenizer(tmp_path)
    assert tok.encode_prompts(TEXTS[:1])[0].shape[0] == 1  # text is fine
    with pytest.raises(HflowError, match="has no chat template"):
        tok.encode_prompts(CHATS)
    with pytest.raises(HflowError, match="the built-in character tokenizer has no chat template"):
        CharTokenizer().encode_prompts(TEXTS[:1], chat=True)


def test_char_tokenizer_is_the_warmed_policy_s_and_never_crashes_on_large_ids(tmp_path):
    from hybridflow.runtime.tasks.policy_cache import check_warmup_shape

    CharTokenizer().save(tmp_path)
    tok = load_tokenizer(tmp_path, model_vocab=64)
    assert isinstance(tok, CharTokenizer) and tok.eos_ids == [tok.eos_id]
    assert tok.decode_responses(torch.tensor([[5, 6, 500, 7, tok.eos_id, 8]])) == ["12?3"]  # no IndexError
    check_warmup_shape(model_preset("tiny"))
    with pytest.raises(HflowError, match="'llama2-7b' has a vocabulary of 32000: the built-in warm-up only builds"):
        check_warmup_shape(model_preset("llama2-7b"))
