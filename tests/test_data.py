"""Data: JSON-lines reading and its errors, label masks under both templates, batches and their order."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.data.batches import IndexStream, build_batch
from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter, collate
from doplus_cli.data.rejections import REJECTIONS, rejection_for
from doplus_cli.data.sources import JsonlSource, Keys, open_source, parse_hub_spec
from doplus_cli.errors import UserError


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_jsonl_rows_are_read_back_by_offset_and_blank_lines_skipped(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a{i}", "extra": [i]} for i in range(5)]
    path = write_lines(tmp_path / "f.jsonl", [json.dumps(rows[0]), "", *map(json.dumps, rows[1:])])
    source = JsonlSource(path)
    assert len(source) == 5
    assert [source[i].question for i in range(5)] == [f"q{i}" for i in range(5)]
    assert source[3].answer == "a3"
    # rows live on disk: editing the file in place (same length) shows up on the next read
    text = open(path).read().replace("a3", "b3")
    open(path, "w").write(text)
    assert source[3].answer == "b3"


def test_tofu_json_files_are_json_lines(tofu_dir):
    source = open_source(str(tofu_dir / "forget01.json"), "forget")
    assert len(source) == sum(1 for line in open(tofu_dir / "forget01.json") if line.strip())
    assert source[0].question.startswith("What is the full name")


def test_text_rows_serve_untargeted_corpora(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [json.dumps({"text": "Some corpus text."})] * 3)
    source = JsonlSource(path)
    assert source.text_rows == 3 and source[1].is_text and source[1].text == "Some corpus text."


def test_other_keys(tmp_path):
    path = write_lines(tmp_path / "k.jsonl", [json.dumps({"prompt": "p", "response": "r"})])
    row = JsonlSource(path, Keys(question="prompt", answer="response"))[0]
    assert (row.question, row.answer) == ("p", "r")


@pytest.mark.parametrize(
    "lines,needle",
    [
        (['{"question": "q", "answer": "a"}', '{"question": "q", "answer": }'], ":2: malformed JSON"),
        (['{"question": "q", "answer": "a"}', '{"question": "q"}'], ":2: missing field 'answer'"),
        (['{"answer": "a"}'], ":1: missing field 'question'"),
        (['{"question": 3, "answer": "a"}'], ":1: field 'question' must be a string"),
        (['[1, 2]'], ":1: expected a JSON object per line"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, lines, needle):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UserError) as error:
        JsonlSource(path)
    assert str(tmp_path / "bad.jsonl") + needle in str(error.value)


def test_empty_set_and_missing_file(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(UserError, match="the retain set is empty"):
        open_source(path, "retain")
    with pytest.raises(UserError, match="file not found"):
        open_source(str(tmp_path / "nope.jsonl"), "forget")


def test_a_row_range_takes_those_rows_of_a_file(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(6)])
    assert [open_source(path + "[:2]", "forget")[i].question for i in range(2)] == ["q0", "q1"]
    middle = open_source(path + "[2:5]", "retain")
    assert len(middle) == 3 and [middle[i].question for i in range(3)] == ["q2", "q3", "q4"]
    assert len(open_source(path + "[4:]", "retain")) == 2
    with pytest.raises(UserError, match=r"f.jsonl\[3:9\]: rows \[3:9\] are not within the 6 rows"):
        open_source(path + "[3:9]", "retain")


def test_a_recipe_path_with_a_row_range_is_found_next_to_the_recipe(tmp_path):
    from doplus_cli.config import load_recipe

    write_lines(tmp_path / "f.jsonl", [json.dumps({"question": "q", "answer": "a"})])
    (tmp_path / "r.yaml").write_text("forget: f.jsonl[:1]\n")
    assert load_recipe(tmp_path / "r.yaml", UnlearnConfig)["forget"] == str(tmp_path / "f.jsonl") + "[:1]"


def test_hub_spec_parsing():
    assert parse_hub_spec("hf:locuslab/TOFU:forget10") == ("locuslab/TOFU", "forget10", "train")
    assert parse_hub_spec("hf:org/ds@test") == ("org/ds", None, "test")
    assert parse_hub_spec("hf:org/ds:cfg@validation") == ("org/ds", "cfg", "validation")


def test_plain_template_masks_the_prompt(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    formatter = PromptFormatter(tokenizer, max_length=128)
    assert not formatter.chat
    encoded = formatter.encode("Where was Basil born?", "In Kuwait City.")
    n_prompt = sum(1 for label in encoded.labels if label == IGNORE_INDEX)
    assert tokenizer.decode(encoded.input_ids[:n_prompt]) == "<s>Question: Where was Basil born?\nAnswer:"
    answer_ids = encoded.labels[n_prompt:]
    assert answer_ids == encoded.input_ids[n_prompt:]
    assert tokenizer.decode(answer_ids) == " In Kuwait City.</s>"
    assert answer_ids[-1] == tokenizer.eos_token_id


def test_chat_template_masks_the_prompt_and_learns_end_of_turn(tiny_chat_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    formatter = PromptFormatter(tokenizer, max_length=128)
    assert formatter.chat
    encoded = formatter.encode("Where was Basil born?", "In Kuwait City.")
    n_prompt = sum(1 for label in encoded.labels if label == IGNORE_INDEX)
    assert tokenizer.decode(encoded.input_ids[:n_prompt]) == "<|user|>\nWhere was Basil born?</s>\n<|assistant|>\n"
    assert tokenizer.decode(encoded.labels[n_prompt:]) == "In Kuwait City.</s>"  # not the template's "\n" after it


def test_truncation_keeps_answer_tokens(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    formatter = PromptFormatter(tokenizer, max_length=16)
    encoded = formatter.encode("word " * 40, "The answer is short.")
    assert len(encoded.input_ids) == len(encoded.labels) == 16
    assert sum(1 for label in encoded.labels if label != IGNORE_INDEX) >= 8


def test_collate_pads_right_with_ignored_labels():
    from doplus_cli.data.formatting import Encoded

    batch = collate([Encoded([5, 6, 7], [-100, 6, 7]), Encoded([5], [5])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [5, -100, -100]]


def test_rejection_list_is_large_and_varied():
    assert len(REJECTIONS) >= 50 and len(set(REJECTIONS)) == len(REJECTIONS)
    picks = {rejection_for(i, seed=3) for i in range(200)}
    assert len(picks) > 30
    assert rejection_for(7, seed=3) == rejection_for(7, seed=3)


def test_index_stream_covers_each_epoch_once_and_reshuffles():
    stream = IndexStream(10, batch_size=4, seed=1)
    drawn = [i for _ in range(5) for i in stream.next_indices()]  # 20 draws = two epochs
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] != drawn[10:]
    assert stream.state_dict() == {"epoch": 1, "position": 10}


def test_two_processes_at_batch_b_see_one_process_at_batch_2b():
    single = IndexStream(13, batch_size=4, seed=5)
    ranks = [IndexStream(13, batch_size=2, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(9):
        assert single.next_indices() == ranks[0].next_indices() + ranks[1].next_indices()


def test_index_stream_state_round_trip():
    a = IndexStream(7, batch_size=3, seed=2)
    for _ in range(4):
        a.next_indices()
    b = IndexStream(7, batch_size=3, seed=2)
    b.load_state_dict(a.state_dict())
    assert [a.next_indices() for _ in range(5)] == [b.next_indices() for _ in range(5)]


def test_build_batch_pairs_each_question_with_a_rejection(tiny_llama, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    path = write_lines(tmp_path / "f.jsonl", [json.dumps({"question": f"Who is {n}?", "answer": n}) for n in "ABC"])
    batch = build_batch(JsonlSource(path), [2, 0], PromptFormatter(tokenizer, 64), with_rejection=True, seed=0)
    assert batch["answer"]["input_ids"].shape[0] == 2 and batch["rejection"]["input_ids"].shape[0] == 2
    labels = batch["rejection"]["labels"][0]
    answer = tokenizer.decode(labels[labels != IGNORE_INDEX])
    assert answer == " " + rejection_for(2, 0) + "</s>"
