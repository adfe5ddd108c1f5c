"""Data: JSONL and Parquet rows (prompt/response or messages), chat templates and loss masks, truncation.

Chat rendering is checked against the reference with real tokenizers and templates: the tiny model's own (ChatML)
and a Llama-3-style one built here (header tokens, bos from the template, content trimmed, <|eot_id|> an added
special token that is not among the named ones): the ids are what apply_chat_template gives, and the trained tokens
decode to exactly each assistant turn's content followed by its end-of-turn token.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fakes import fake_workers
from helpers import REPO, compose, read_jsonl, run_cli, run_fake_cli, run_script
from tinker_exp import config
from tinker_exp.config import DataConfig, data_path
from tinker_exp.config.schema import DataFormat, Truncation
from tinker_exp.errors import ConfigError
from tinker_exp.place import GivenWorkers
from tinker_exp.run import run
from tinker_exp.runtime.inputs import model_dir
from tinker_exp.train.chat import chat_tokens, special_ids
from tinker_exp.train.data import Row, dataset_rows, read_rows, tokenize

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Double it."},
    {"role": "assistant", "content": "5 times 2 is 10."},
]
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's chat template
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def typed(*overrides: str):
    return config.load(compose(*overrides))


def shipped_conversations() -> list[list[dict[str, str]]]:
    rows = read_rows(data_path("builtin:tiny_chat.jsonl"), DataConfig())
    return [[{"role": role, "content": content} for role, content in row.messages] for row in rows]


@pytest.fixture(scope="session")
def tiny_model_path():
    return model_dir(typed().model)


def test_a_model_config_made_in_python_builds_its_tiny_model_in_the_cache_hydra_would_use(tiny_model_path, tmp_path, monkeypatch):
    from tinker_exp.config import ModelConfig

    monkeypatch.chdir(tmp_path)  # an unresolved default was once a folder named "${oc.env:..." here
    assert model_dir(ModelConfig()) == tiny_model_path  # TINKER_EXP_CACHE (conftest), as the composed config's
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def tiny_tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)  # fresh: a test may change its template


@pytest.fixture(scope="session")
def llama3_style_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([m["content"] for conv in shipped_conversations() for m in conv], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    tokenizer.chat_template = LLAMA3_TEMPLATE
    out = tmp_path_factory.mktemp("llama3_style")
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)  # as a model dir is loaded


def trained_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The ids of each maximal run of trained tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def assert_like_the_reference(tokenizer, messages, end_of_turn: str) -> None:
    ids, mask = chat_tokens(messages, tokenizer, "row", special_ids(tokenizer))
    assert ids == tokenizer.apply_chat_template(messages, return_dict=False)
    decoded = [tokenizer.decode(run) for run in trained_runs(ids, mask)]
    assert decoded == [m["content"].strip() + end_of_turn for m in messages if m["role"] == "assistant"]


# --- the reference: ids as apply_chat_template, trained tokens = assistant contents + end of turn ---------------


def test_every_shipped_conversation_matches_the_tiny_models_chatml_template(tiny_tokenizer):
    assert "<|im_start|>" in tiny_tokenizer.chat_template
    for messages in shipped_conversations():
        assert_like_the_reference(tiny_tokenizer, messages, "<|im_end|>")


def test_a_llama3_style_template_gets_the_same_treatment(llama3_style_tokenizer):
    tokenizer = llama3_style_tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot not in tokenizer.all_special_ids and eot in special_ids(tokenizer)  # as in Llama 3's own tokenizer
    for messages in [CHAT, *shipped_conversations()[:40]]:
        assert_like_the_reference(tokenizer, messages, "<|eot_id|>")
    ids, _ = chat_tokens(CHAT, tokenizer, "row", special_ids(tokenizer))
    assert ids[0] == tokenizer.bos_token_id  # the template adds it, nothing else does
    # The template trims contents: the trained tokens are what it renders, up to and with <|eot_id|>.
    padded = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there.\n"}]
    assert_like_the_reference(tokenizer, padded, "<|eot_id|>")


def test_a_special_tokens_text_inside_an_assistant_turn_does_not_end_it_early(tiny_tokenizer):
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "a <|im_end|> b"}]
    ids, mask = chat_tokens(messages, tiny_tokenizer, "row", special_ids(tiny_tokenizer))
    assert [tiny_tokenizer.decode(run) for run in trained_runs(ids, mask)] == ["a <|im_end|> b<|im_end|>"]


@pytest.mark.parametrize(
    "template, message",
    [
        (  # renders the last assistant turn differently (an empty reasoning block, as reasoning models' templates do)
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think></think>"
            "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "the chat template does not render messages[2] (assistant) the same with and without the turns after it",
        ),
        (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
            "the chat template puts no special token (end of turn) after messages[2] (assistant)",
        ),
        (
            "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
            "the chat template refuses this conversation (System role not supported)",
        ),
    ],
)
def test_a_template_whose_turns_cannot_be_located_is_refused_naming_the_row(tiny_tokenizer, template, message):
    tiny_tokenizer.chat_template = template
    row = Row("data.path: chat.jsonl:7", "data.path: chat.jsonl", messages=tuple((m["role"], m["content"]) for m in CHAT))
    with pytest.raises(ConfigError, match="^" + re.escape(f"data.path: chat.jsonl:7: {message}")):
        tokenize([row], tiny_tokenizer, DataConfig())


def test_messages_rows_need_a_chat_template(tiny_tokenizer):
    tiny_tokenizer.chat_template = None
    rows = read_rows(data_path("builtin:tiny_chat.jsonl"), DataConfig())
    with pytest.raises(ConfigError, match=r"^data.path: .*tiny_chat.jsonl:1: messages rows need a chat template, and the tokenizer of .* has none"):
        tokenize(rows, tiny_tokenizer, DataConfig())


# --- reading: JSONL and Parquet, format detection, bad rows ----------------------------------------------------


def write_parquet(path, columns: dict) -> None:
    pq.write_table(pa.table(columns), path)


def test_jsonl_and_parquet_hold_the_same_rows_in_either_format(tmp_path):
    conversations = [CHAT, CHAT[1:3]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    write_parquet(tmp_path / "chat.parquet", {"messages": conversations, "id": [0, 1]})
    (tmp_path / "sft.jsonl").write_text('{"q": "a", "a": "b"}\n\n{"q": "c", "a": "d"}\n')
    write_parquet(tmp_path / "sft.parquet", {"q": ["a", "c"], "a": ["b", "d"]})
    data = DataConfig()
    jsonl, parquet = read_rows(tmp_path / "chat.jsonl", data), read_rows(tmp_path / "chat.parquet", data)
    assert [r.messages for r in jsonl] == [r.messages for r in parquet] == [tuple((m["role"], m["content"]) for m in c) for c in conversations]
    assert [r.where for r in jsonl] == [f"data.path: {tmp_path}/chat.jsonl:1", f"data.path: {tmp_path}/chat.jsonl:2"]
    assert [r.where for r in parquet] == [f"data.path: {tmp_path}/chat.parquet: row 0", f"data.path: {tmp_path}/chat.parquet: row 1"]
    keys = DataConfig(prompt_key="q", response_key="a")
    for name in ("sft.jsonl", "sft.parquet"):
        assert [(r.prompt, r.response, r.messages) for r in read_rows(tmp_path / name, keys)] == [("a", "b", None), ("c", "d", None)]
    # auto detects each file's format; the training and the validation file may differ
    train, val = dataset_rows(typed(f"data.path={tmp_path}/chat.parquet", f"data.val_path={tmp_path}/sft.jsonl",
                                    "data.prompt_key=q", "data.response_key=a").data)  # fmt: skip
    assert len(train) == 2 and train[0].messages and val[0].prompt == "a"
    raw = tmp_path / "raw.jsonl"  # as json.dumps(ensure_ascii=False) writes them: line separators inside strings
    raw.write_text(json.dumps({"messages": CHAT[1:2] + [{"role": "assistant", "content": "a\u2028b\u0085c"}]}, ensure_ascii=False) + "\r\n")
    assert read_rows(raw, data)[0].messages[1] == ("assistant", "a\u2028b\u0085c")
    renamed = DataConfig(messages_key="conversation")
    (tmp_path / "renamed.jsonl").write_text(json.dumps({"conversation": CHAT}) + "\n")
    assert read_rows(tmp_path / "renamed.jsonl", renamed)[0].messages == jsonl[0].messages


def test_a_split_of_messages_rows_keeps_copies_on_one_side(tmp_path):
    lines = [json.dumps({"messages": conv}) for conv in shipped_conversations()[:40]]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines + lines[:5]) + "\n")  # five conversations twice
    train, val = dataset_rows(typed(f"data.path={tmp_path}/chat.jsonl", "data.val_fraction=0.25").data)
    assert len(train) + len(val) == 45 and not {r.identity for r in train} & {r.identity for r in val}


M = '{"messages": %s}\n'
OK = M % json.dumps(CHAT)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "data.path: {path} is empty"),
        ("\n \n", "data.path: {path} has no rows"),
        (OK + "{not json\n", "data.path: {path}:2: not valid JSON (Expecting property name enclosed in double quotes)"),
        (b"\xff\xfe{}\n", "data.path: {path}: not UTF-8 text (invalid start byte at byte 0)"),
        (OK + "[1]\n", "data.path: {path}:2: expected a JSON object, got list"),
        ('{"text": "x"}\n', "data.path: {path}:1: neither a 'messages' field (messages rows) nor 'prompt' and 'response' (prompt/response rows); fields: ['text']"),
        (OK + M % '[{"role": "robot", "content": "x"}]', "data.path: {path}:2: messages[0]: unknown role 'robot' (known: system, user, assistant)"),
        (M % '[{"content": "x"}]', "data.path: {path}:1: messages[0]: no role (known: system, user, assistant)"),
        (M % '[{"role": "user"}, {"role": "assistant", "content": "x"}]', "data.path: {path}:1: messages[0]: content must be a string, got nothing"),
        (M % '[{"role": "user", "content": ["x"]}]', "data.path: {path}:1: messages[0]: content must be a string, got list"),
        (M % '[{"role": "assistant", "content": null}]', "data.path: {path}:1: messages[0]: content must be a string, got null"),
        (M % '[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]', "data.path: {path}:1: the conversation has no assistant turn (nothing to train on)"),
        (M % '"hi"', "data.path: {path}:1: 'messages' must be a non-empty list of {{role, content}} turns, got str"),
        (M % "[]", "data.path: {path}:1: 'messages' must be a non-empty list of {{role, content}} turns, got an empty list"),
        (M % '["hi"]', "data.path: {path}:1: messages[0]: expected an object with role and content, got str"),
        (OK + '{"prompt": "a", "response": "b"}\n', "data.path: {path}:2: 'messages' must be a non-empty list of {{role, content}} turns, got null"),
    ],
)
def test_a_bad_jsonl_file_is_a_config_error_naming_file_and_row(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        read_rows(path, DataConfig())
    assert str(info.value) == message.format(path=path)


def test_a_bad_parquet_file_is_a_config_error_naming_file_and_row(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text('{"prompt": "a", "response": "b"}\n')
    with pytest.raises(ConfigError, match=f"^data.path: {re.escape(str(path))}: not a valid Parquet file \\(.*magic bytes"):
        read_rows(path, DataConfig())
    cases = {
        "empty": ({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))}, "{path} has no rows"),
        "null": ({"messages": [CHAT, [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]]},
                 "{path}: row 1: messages[1]: content must be a string, got null"),
        "role": ({"messages": [[{"role": "tool", "content": "x"}]]}, "{path}: row 0: messages[0]: unknown role 'tool' (known: system, user, assistant)"),
        "sft": ({"prompt": ["a", None], "response": ["b", "c"]}, "{path}: row 1: missing string field 'prompt'"),
    }  # fmt: skip
    for name, (columns, message) in cases.items():
        path = tmp_path / f"{name}.parquet"
        write_parquet(path, columns)
        with pytest.raises(ConfigError) as info:
            read_rows(path, DataConfig(), key="data.val_path")
        assert str(info.value) == "data.val_path: " + message.format(path=path)


def test_an_explicit_format_is_held_to(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": CHAT, "prompt": "a", "response": "b"}) + "\n")
    assert read_rows(path, DataConfig())[0].messages  # auto: messages first
    assert read_rows(path, DataConfig(format=DataFormat.prompt_response))[0].prompt == "a"
    path.write_text('{"prompt": "a", "response": "b"}\n')
    with pytest.raises(ConfigError, match="^data.path: .*:1: 'messages' must be a non-empty list"):
        read_rows(path, DataConfig(format=DataFormat.messages))


# --- truncation -------------------------------------------------------------------------------------------------


def rows_of(*items) -> list[Row]:
    rows = []
    for i, item in enumerate(items, start=1):
        where = f"data.path: d.jsonl:{i}"
        rows.append(Row(where, "data.path: d.jsonl", *item) if isinstance(item, tuple) else
                    Row(where, "data.path: d.jsonl", messages=tuple((m["role"], m["content"]) for m in item)))  # fmt: skip
    return rows


def test_truncation_right_left_drop_and_error(tiny_tokenizer):
    long_response = ("Add 2 and 3.", " ".join(["river apple cloud"] * 20))
    rows = rows_of(("Spell river.", " r-i-v-e-r"), long_response, CHAT)
    full = tokenize(rows, tiny_tokenizer, DataConfig(max_length=1000)).examples
    n = 40
    assert len(full[0].input_ids) < n < len(full[1].input_ids) and n < len(full[2].input_ids)

    right = tokenize(rows, tiny_tokenizer, DataConfig(max_length=n))
    assert (right.rows, right.cut, right.too_long, right.untrained) == (3, 2, 0, 0)
    assert [(e.input_ids, e.loss_mask) for e in right.examples] == [
        (e.input_ids[:n], e.loss_mask[:n]) for e in full
    ]
    assert right.describe(DataConfig(max_length=n)) == "3 rows: 2 cut to 40 tokens (right), 0 dropped"

    left = tokenize(rows, tiny_tokenizer, DataConfig(max_length=n, truncation=Truncation.left))
    assert [(e.input_ids, e.loss_mask) for e in left.examples] == [(e.input_ids[-n:], e.loss_mask[-n:]) for e in full]
    assert tiny_tokenizer.decode(left.examples[2].input_ids).endswith("5 times 2 is 10.<|im_end|>\n")

    drop = tokenize(rows, tiny_tokenizer, DataConfig(max_length=n, truncation=Truncation.drop))
    assert [e.input_ids for e in drop.examples] == [full[0].input_ids]
    assert drop.describe(DataConfig(max_length=n, truncation=Truncation.drop)) == (
        "3 rows: 0 cut to 40 tokens (drop), 2 dropped (2 longer than 40 tokens)"
    )

    with pytest.raises(ConfigError, match=rf"^data.path: d.jsonl:2: {len(full[1].input_ids)} tokens, more than data.max_length=40 \(data.truncation=error\)$"):
        tokenize(rows, tiny_tokenizer, DataConfig(max_length=n, truncation=Truncation.error))


def test_a_row_left_with_no_trained_token_is_dropped_and_all_dropped_is_an_error(tiny_tokenizer):
    long_prompt = (" ".join(["river apple cloud"] * 20), "ok")
    rows = rows_of(long_prompt, ("Hi", "ok"))
    cut = tokenize(rows, tiny_tokenizer, DataConfig(max_length=20))
    assert (len(cut.examples), cut.cut, cut.untrained) == (1, 1, 1)
    assert cut.describe(DataConfig(max_length=20)) == "2 rows: 1 cut to 20 tokens (right), 1 dropped (1 with no trained token left)"
    with pytest.raises(ConfigError, match=r"^data.path: d.jsonl: every training row is dropped at data.max_length=20 \(data.truncation=right\): 0 longer, 1 with no trained token left$"):
        tokenize(rows[:1], tiny_tokenizer, DataConfig(max_length=20))
    with pytest.raises(ConfigError, match=r"^data.path: d.jsonl: every validation row is dropped at data.max_length=3 \(data.truncation=drop\): 2 longer, 0 with"):
        tokenize(rows, tiny_tokenizer, DataConfig(max_length=3, truncation=Truncation.drop), "validation")


def test_prompt_response_rows_are_tokenized_as_before(tiny_tokenizer):
    (example,) = tokenize(rows_of(("Spell river.", " r-i-v-e-r")), tiny_tokenizer, DataConfig()).examples
    prompt = [tiny_tokenizer.bos_token_id] + tiny_tokenizer.encode("Spell river.\n", add_special_tokens=False)
    response = tiny_tokenizer.encode(" r-i-v-e-r", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    assert example.input_ids == prompt + response and example.loss_mask == [0] * len(prompt) + [1] * len(response)


# --- the shipped chat set, the run's start and the CLI ----------------------------------------------------------


def test_the_shipped_chat_set_is_what_its_script_writes():
    result = run_script(REPO / "scripts" / "make_tiny_chat.py", "--check")
    assert result.returncode == 0, result.stderr
    conversations = shipped_conversations()
    assert 100 <= len(conversations) <= 200
    assert sum(c[0]["role"] == "system" for c in conversations) >= 20
    assert sum(sum(m["role"] == "assistant" for m in c) >= 2 for c in conversations) >= 20


def test_a_run_on_the_chat_set_reports_truncation_at_its_start(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tinker_exp")
    start = fake_workers()
    run(compose("data=tiny_chat", "trainer.steps=2", "logger=none"), tmp_path, place=GivenWorkers(start))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    match = re.fullmatch(
        r"data: training (\d+) rows: (\d) cut to 128 tokens \(right\), 0 dropped; validation (\d+) rows: (\d) cut to 128 "
        r"tokens \(right\), 0 dropped", line
    )
    assert match, line
    train_rows, train_cut, val_rows, val_cut = map(int, match.groups())
    assert train_rows + val_rows == 160 and train_cut + val_cut == 1  # one shipped conversation is 130 tokens


@pytest.mark.parametrize("case", ["no chat template", "every row dropped", "unknown role"])
def test_bad_chat_data_stops_the_cli_in_one_line_before_any_worker(tmp_path, tiny_model_path, case):
    run_dir, data = tmp_path / "run", data_path("builtin:tiny_chat.jsonl")
    if case == "no chat template":
        model = tmp_path / "model"
        shutil.copytree(tiny_model_path, model)
        (model / "chat_template.jinja").unlink()
        args = [f"model.path={model}"]
        line = f"data.path: {data}:1: messages rows need a chat template, and the tokenizer of {model} has none"
    elif case == "every row dropped":
        args = ["data.max_length=15", "data.truncation=drop"]  # the shortest conversation is 16 tokens
        line = f"data.path: {data}: every training row is dropped at data.max_length=15 (data.truncation=drop): 145 longer, 0 with no trained token left"
    else:  # found before anything is imported or built: a dry run finds it too
        bad = tmp_path / "bad.jsonl"
        bad.write_text(OK + M % '[{"role": "human", "content": "x"}]')
        args = [f"data.path={bad}", "dry_run=true"]
        line = f"data.path: {bad}:2: messages[0]: unknown role 'human' (known: system, user, assistant)"
    result = run_cli("data=tiny_chat", "logger=none", *args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"tinker_exp: config error: {line}"]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (run_dir / "workers.log").exists() and not (run_dir / "metrics.jsonl").exists()


def test_a_run_on_the_chat_set_prints_its_cut_and_trains(tmp_path):
    """The real CLI with FakeWorkers (tests/fake_cli.py): the chat examples (assistant turns masked) reach the
    workers, and the start reports the cut on the terminal. The chat set on verl's workers: test_models.py's real run
    (a Qwen2 from the hub cache, LoRA), whose loss falls."""
    result = run_fake_cli("data=tiny_chat", "trainer.steps=4", "logger=none", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: training 145 rows: 1 cut to 128 tokens (right), 0 dropped; validation 15 rows: 0 cut" in result.stdout
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == [0, 1, 2, 3] and rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert rows[-1]["val/tokens"] > 0


def test_a_data_path_under_the_home_dir_is_read_as_model_path_is(tmp_path, monkeypatch):
    """data.path='"~/rows.jsonl"' (quoted: Hydra's grammar reads ~ only so) is the home dir's file, as model.path's ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    assert data_path("~/rows.jsonl") == tmp_path / "rows.jsonl"
    with pytest.raises(ConfigError, match=rf"^data.val_path: no such file: '~/other.jsonl' \(looked at {tmp_path}/other.jsonl\)$"):
        data_path("~/other.jsonl", "data.val_path")
