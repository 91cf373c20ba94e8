"""Greedy decoding with the KV cache equals recomputing the whole sequence at every step."""

import pytest
import torch
from test_modeling import MODES, build, randomise_routing


def recompute_greedy(model, input_ids, attention_mask, new_tokens):
    """Greedy decoding without a cache: the full (left-padded) sequence is re-run at each step."""
    for _ in range(new_tokens):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=-1)
    return input_ids


@pytest.mark.parametrize("mode", MODES)
def test_cached_generation_equals_recomputation_with_left_padding(mode):
    model = randomise_routing(build(mode, attn="eager"), scale=3.0)
    with torch.no_grad():  # sharpen the output distribution so greedy choices are not near-ties
        model.lm_head.weight.mul_(20)
    prompts = [torch.randint(2, 384, (n,)) for n in (9, 5, 7)]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((3, width), 1)  # pad id 1, left padding
    attention_mask = torch.zeros(3, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = prompt
        attention_mask[row, width - len(prompt):] = 1

    cached = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8,
                            do_sample=False, use_cache=True, pad_token_id=1, eos_token_id=None)
    expected = recompute_greedy(model, input_ids, attention_mask, 8)
    assert torch.equal(cached, expected)
    uncached = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8,
                              do_sample=False, use_cache=False, pad_token_id=1, eos_token_id=None)
    assert torch.equal(uncached, expected)
    # each row equals generating its prompt alone, unpadded
    for row, prompt in enumerate(prompts):
        alone = model.generate(input_ids=prompt[None], max_new_tokens=8, do_sample=False,
                               pad_token_id=1, eos_token_id=None)
        assert torch.equal(alone[0, -8:], cached[row, -8:])


@pytest.mark.parametrize("mode", MODES)
def test_incremental_forward_with_a_cache_equals_one_full_forward(mode):
    model = randomise_routing(build(mode, attn="eager"))
    tokens = torch.randint(2, 384, (2, 10))
    with torch.no_grad():
        full = model(tokens).logits
        first = model(tokens[:, :6], use_cache=True)
        rest = model(tokens[:, 6:], cache=first.cache, use_cache=True).logits  # positions come from the cache
    torch.testing.assert_close(torch.cat([first.logits, rest], dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_assisted_decoding_equals_greedy(mode):
    """Assisted (speculative) decoding reads the hidden states of each step; whatever the
    assistant proposes, greedy verification must give the model's own greedy tokens."""
    model = randomise_routing(build(mode, attn="eager"), scale=3.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    assistant = build("standard", attn="eager", num_hidden_layers=2)
    prompt = torch.randint(2, 384, (1, 7))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    greedy = model.generate(prompt, **settings)
    assisted = model.generate(prompt, assistant_model=assistant, **settings)
    assert torch.equal(assisted, greedy)
    returned = model.generate(prompt, output_hidden_states=True, return_dict_in_generate=True, **settings)
    assert torch.equal(returned.sequences, greedy)
    assert len(returned.hidden_states) == 12  # one tuple per step, each of every layer's states
    assert all(len(step) == model.config.num_hidden_layers + 1 for step in returned.hidden_states)
