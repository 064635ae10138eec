"""The chat templates and ends of turn of the families people fine-tune (Llama 3.1, Qwen3, Gemma 3, Mistral
v0.3): each renders a conversation to the text ``transformers``' ``apply_chat_template`` renders, chat records
become its token ids with the last reply and its end of turn as the only targets, and ``distlab generate
--chat`` stops where ``transformers``' ``generate`` stops -- at the family's end of turn, whichever file lists
it (config.json, generation_config.json or tokenizer_config.json's ``eos_token``).

Each template below is the one its instruct checkpoints publish in ``tokenizer_config.json`` (their
tool-calling branches left out: distlab renders conversations, not tool calls); each tokenizer is a tiny BPE
holding the family's special tokens, and the ids of the ends are whatever it gives them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import invoke

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

MISTRAL03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# family: (architecture, special tokens (the first ids), tokenizer_config's bos/eos, its end of turn, the ends
# config.json and generation_config.json list -- as names --, the template)
FAMILIES = {
    "llama3": ("LlamaForCausalLM", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"],
               ("<|begin_of_text|>", "<|eot_id|>"), "<|eot_id|>",
               (["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
               LLAMA31),
    "qwen3": ("Qwen3ForCausalLM", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
              (None, "<|im_end|>"), "<|im_end|>", ("<|im_end|>", ["<|im_end|>", "<|endoftext|>"]), QWEN3),
    # Gemma 3: its end of turn listed in generation_config.json only (as the 4B's config.json has it)
    "gemma3": ("Gemma3ForCausalLM", ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
               ("<bos>", "<eos>"), "<end_of_turn>", ("<eos>", ["<eos>", "<end_of_turn>"]), GEMMA3),
    "mistral": ("MistralForCausalLM", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], ("<s>", "</s>"), "</s>",
                ("</s>", None), MISTRAL03),
}
TALKS = [[{"role": "user", "content": "the fox?"}, {"role": "assistant", "content": "the lazy dog"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox?"},
          {"role": "assistant", "content": " the dog "}, {"role": "user", "content": "over the dog?"},
          {"role": "assistant", "content": "the quick brown fox"}]]
WIDTH = 320  # the model's width and vocabulary: a token's embedding is a one-hot row (the bigram model below)


def _transformers():
    return pytest.importorskip("transformers", reason="transformers (the test extra) is not installed: "
                                                      "pip install -e '.[test]' runs the interop tests")


def _family_dir(family: str, path):
    """The family's tokenizer files (a BPE with its special tokens first), config.json / generation_config.json
    listing its ends; returns the tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    _, special, (bos, eos), _, (config_ends, generation_ends), template = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    ids = (lambda names: [tok.token_to_id(n) for n in names] if isinstance(names, list) else tok.token_to_id(names))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": template,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "config.json").write_text(json.dumps({"vocab_size": WIDTH, "eos_token_id": ids(config_ends),
                                                  "bos_token_id": ids(bos) if bos else None}))
    if generation_ends:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids(generation_ends)}))
    return tok


def _reply_spans(theirs, talk: list, end: int, every: bool) -> list[int]:
    """The token ids of the assistant's replies in transformers' ids of ``talk``: reply ``i`` from the end of
    the conversation before it (with the generation prompt) to the end of the conversation through it -- or,
    where the template renders that reply otherwise when it is last (Qwen3's reasoning), through the first
    end of turn ``end`` after its start; the last reply to the conversation's end."""
    ids = (lambda msgs, **kw: theirs.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)["input_ids"])
    whole, out = ids(talk), []
    for i in [i for i, m in enumerate(talk) if m["role"] == "assistant" and (every or i == len(talk) - 1)]:
        start = len(ids(talk[:i], add_generation_prompt=True))
        through = ids(talk[:i + 1])
        stop = len(whole) if i == len(talk) - 1 else len(through) if whole[:len(through)] == through else \
            whole.index(end, start) + 1
        out += whole[start:stop]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_familys_template_renders_as_transformers_and_its_records_train_on_every_reply_and_end_of_turn(family,
                                                                                                        tmp_path):
    """The family's published template: the conversations (a system message, two turns) render to the text
    transformers renders, with and without the generation prompt; as sft: records, each window's tokens are
    transformers' ids of the conversation and its targets every assistant reply through the end of turn the
    template writes (no end of text after the last) -- with `chat_turns` last, the last reply only; the
    tokenizer stops at that end of turn."""
    from distlab.data import load_dataset
    from distlab.data.chat import ChatTemplate
    from distlab.data.tokenizer import HFTokenizer
    from distlab.models import IGNORE_INDEX
    tok = _family_dir(family, tmp_path / "m")
    theirs = _transformers().AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    mine = ChatTemplate.from_dir(tmp_path / "m")
    talks = TALKS if family != "mistral" else [t[1:] if t[0]["role"] == "system" else t for t in TALKS]
    for talk in talks:
        for cut, prompt in ((len(talk), False), (len(talk) - 1, True)):
            assert mine.render(talk[:cut], prompt) == theirs.apply_chat_template(talk[:cut], tokenize=False,
                                                                                 add_generation_prompt=prompt)
    end = tok.token_to_id(FAMILIES[family][3])
    assert end in HFTokenizer.from_dir(str(tmp_path / "m")).stops
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks * 5))
    stops = HFTokenizer.from_dir(str(tmp_path / "m")).stops
    for turns in ("all", "last"):
        data = load_dataset(f"sft:{tmp_path / 'chat.jsonl'}", "train", block_size=192,
                            tokenizer=f"hf:{tmp_path / 'm'}", chat_turns=turns)
        x, y = data.batch(torch.arange(len(talks)))
        for talk, xs, ys in zip(talks, x, y):
            whole = theirs.apply_chat_template(talk, tokenize=True, return_dict=True)["input_ids"]
            assert xs[:len(whole)].tolist() == whole
            targets = ys[ys != IGNORE_INDEX].tolist()
            assert targets == _reply_spans(theirs, talk, end, turns == "all"), \
                (family, turns, tok.decode(targets, skip_special_tokens=False))
            assert targets.count(end) == (sum(m["role"] == "assistant" for m in talk) if turns == "all" else 1)
            last = len(targets) - targets[::-1].index(end)  # nothing that ends a text after the last end of turn
            assert not set(targets[last:]) & stops


def test_mistrals_system_message_placed_only_before_a_reply_is_refused_in_one_line(tmp_path):
    """Mistral v0.3's template puts the system message in the last user turn only when no reply follows: the
    conversation before the reply renders as other text than the whole conversation's start, so which tokens
    are the reply cannot be told -- refused in one line naming the record, not trained on a wrong mask."""
    from distlab.data import load_dataset
    from distlab.errors import ConfigError
    _family_dir("mistral", tmp_path / "m")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": TALKS[1]}) + "\n" for _ in range(10)))
    with pytest.raises(ConfigError, match=r"chat.jsonl:1: the chat template renders the conversation before "
                                          r"reply 1 of 2 .* cannot be told apart .*drop it"):
        load_dataset(f"sft:{tmp_path / 'chat.jsonl'}", "train", block_size=96, tokenizer=f"hf:{tmp_path / 'm'}")


def _bigram(family: str, path, tok) -> list[str]:
    """A one-layer checkpoint of ``family`` that is a bigram table: one-hot embeddings, the attention's and
    the MLP's outputs zero, the LM head mapping each token to its successor -- any token to "the", "the" to
    " lazy", " lazy" to " dog", " dog" to the family's end of turn, the end of turn to "the" again. Greedy
    text is "the lazy dog" and then the end of turn; a generator that does not stop there goes on."""
    transformers = _transformers()
    arch = FAMILIES[family][0]
    kind = {"LlamaForCausalLM": "LlamaConfig", "Qwen3ForCausalLM": "Qwen3Config",
            "Gemma3ForCausalLM": "Gemma3TextConfig", "MistralForCausalLM": "MistralConfig"}[arch]
    config = getattr(transformers, kind)(
        vocab_size=WIDTH, hidden_size=WIDTH, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        **{k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "vocab_size"})
    model = getattr(transformers, arch)(config).eval()
    chain = [tok.token_to_id(t) for t in ("the", "Ġlazy", "Ġdog", FAMILIES[family][3])]
    successor = torch.full((WIDTH,), chain[0])
    successor[chain[:-1]] = torch.tensor(chain[1:])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(0.0 if family == "gemma3" else 1.0)  # Gemma's norms scale by (1 + w)
        model.model.embed_tokens.weight.copy_(torch.eye(WIDTH))
        model.lm_head.weight.copy_(torch.eye(WIDTH)[successor].T)  # logit of n: [successor(t) == n]
    model.save_pretrained(path)  # (which writes a generation_config.json of config.json's ends: the family's back)
    if FAMILIES[family][4][1]:
        ends = [tok.token_to_id(n) for n in FAMILIES[family][4][1]]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_chat_stops_at_the_familys_end_of_turn_where_transformers_stops(family, tmp_path):
    """`distlab generate hf:DIR --chat` (in this process: the command a user types) prints the reply that
    transformers' greedy generate gives -- both stop at the family's end of turn, which Gemma 3 lists in
    generation_config.json only and Llama 3.1 between two other ends."""
    tok = _family_dir(family, tmp_path / "m")
    theirs = _bigram(family, tmp_path / "m", tok)
    code, out, err = invoke(["generate", f"hf:{tmp_path / 'm'}", "--chat", "--prompt", "the fox?",
                             "--temperature", "0", "--max-new-tokens", "12"], tmp_path)
    assert code == 0, err
    hf_tok = _transformers().AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "the fox?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        new = theirs.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert new[-1] == tok.token_to_id(FAMILIES[family][3]) and len(new) == 4  # it stopped at the end of turn
    assert out == hf_tok.decode(new, skip_special_tokens=True) + "\n" == "the lazy dog\n"


CHATML_MARKED = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}
{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_a_template_that_marks_the_assistants_text_trains_the_tokens_of_transformers_assistant_mask(tmp_path):
    """A ChatML template whose replies are `{% generation %}` blocks (as TRL's assistant_only_loss asks for):
    an sft: chat's targets are exactly the tokens of transformers' `return_assistant_tokens_mask` -- every
    reply and its <|im_end|>, not the newline the template writes after it -- and with `chat_turns` last only
    the last block's."""
    from distlab.data import load_dataset
    from distlab.models import IGNORE_INDEX
    _family_dir("qwen3", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML_MARKED}))
    theirs = _transformers().AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in TALKS * 5))
    for turns in ("all", "last"):
        data = load_dataset(f"sft:{tmp_path / 'chat.jsonl'}", "train", block_size=96, tokenizer=f"hf:{tmp_path / 'm'}",
                            chat_turns=turns)
        x, y = data.batch(torch.arange(len(TALKS)))
        for talk, xs, ys in zip(TALKS, x, y):
            out = theirs.apply_chat_template(talk, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = out["input_ids"], out["assistant_masks"]
            assert xs[:len(ids)].tolist() == ids
            if turns == "last":  # the last block: from the last run of ones
                start = max(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
                mask = [0] * start + mask[start:]
            scored = (ys[:len(ids) - 1] != IGNORE_INDEX).tolist()  # target j is token j + 1
            assert scored == [bool(m) for m in mask[1:]], (turns, talk)
            assert ys[len(ids) - 1:].eq(IGNORE_INDEX).all()
