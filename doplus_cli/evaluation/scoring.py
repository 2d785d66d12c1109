"""Model-side work of an evaluation: mean token NLLs of many answers in batched forward passes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from doplus_cli.data.formatting import IGNORE_INDEX, Encoded, PromptFormatter, collate
from doplus_cli.losses import token_nll
from doplus_cli.progress import count_tokens


@torch.no_grad()
def mean_token_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]], batch_size: int = 16
) -> list[float]:
    """For each (question, answer): the mean NLL of the answer tokens given the prompt.

    Pairs are sorted by length so each batch pads little, then put back in their order. Rows are padded on
    the left (with positions counted from each row's first token), so every answer ends the row and only
    the last `longest answer + 1` positions need logits: with a 50k-token vocabulary the output layer and
    the softmax are a large part of the cost, and the prompt's logits are never used.
    """
    was_training = model.training
    model.eval()
    result = [0.0] * len(pairs)
    try:
        for chunk, batch, keep in answer_batches(model, formatter, pairs, batch_size):
            logits = _answer_logits(model, batch, keep)
            nll, mask = token_nll(logits, batch["labels"][:, -logits.shape[1]:])
            means = (nll.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()
            for i, value in zip(chunk, means):
                result[i] = value
    finally:
        model.train(was_training)
    return result


def answer_batches(model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]],
                   batch_size: int) -> Iterator[tuple[list[int], dict[str, torch.Tensor], int]]:
    """The (question, answer) pairs encoded, sorted by length and cut into batches of `batch_size`: for each, (the
    pairs' indexes, the left-padded batch on the model's device, the positions that need logits: the longest
    answer + 1). The tokens are counted as teacher-forced."""
    device = next(model.parameters()).device
    encoded = [formatter.encode(q, a) for q, a in pairs]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        count_tokens("teacher_forced", sum(len(encoded[i].input_ids) for i in chunk))
        batch = {k: v.to(device) for k, v in left_padded([encoded[i] for i in chunk],
                                                         formatter.tokenizer.pad_token_id).items()}
        keep = 1 + max(sum(1 for label in encoded[i].labels if label != IGNORE_INDEX) for i in chunk)
        yield chunk, batch, keep


def left_padded(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Like `collate`, padded on the left, with position ids that start at 0 on each row's first token."""
    batch = collate(examples, pad_id)
    width = batch["input_ids"].shape[1]
    for row, example in enumerate(examples):
        shift = width - len(example.input_ids)
        for key in ("input_ids", "attention_mask", "labels"):
            batch[key][row] = torch.roll(batch[key][row], shift)
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return batch


def _answer_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: int) -> torch.Tensor:
    """Logits of the last `keep` positions (all positions for models without `logits_to_keep`)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": batch["position_ids"]}
    try:
        return model(**inputs, logits_to_keep=keep).logits
    except TypeError:  # an architecture without logits_to_keep
        return model(**inputs).logits


def grouped_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
    batch_size: int = 16,
) -> list[list[float]]:
    """Mean token NLLs of several answers per question (perturbed answers), in one batched pass."""
    flat = [(q, a) for q, group in zip(questions, answers) for a in group]
    values = mean_token_nlls(model, formatter, flat, batch_size)
    grouped, position = [], 0
    for group in answers:
        grouped.append(values[position:position + len(group)])
        position += len(group)
    return grouped


# Answers of this many batches share one prompt pass: the more answers, the closer in length each batch's rows
# (less padding); the prompts' KV cache of a chunk is small (SmolLM2: about 1.3 MB per question).
ANSWER_ROWS_PER_CHUNK = 16


@torch.no_grad()
def shared_prefix_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
    batch_size: int = 16, progress=None, description: str = "scoring",
) -> list[list[float]]:
    """Mean token NLLs of several answers per question, each question's prompt encoded once.

    Models that take a custom 4D attention mask (transformers' `sdpa` and `eager` attention) score each question
    as one packed row (`_packed_nlls`): its prompt, then the token tree of its answers, every answer token seeing
    only the prompt and its own answer's earlier tokens; answer prefixes that several answers share are run once.
    Other models take `_cached_prefix_nlls`: the prompts' KV cache, expanded over the answers. Either way the
    tokens and positions are those of `mean_token_nlls`, so the values agree with it to float rounding. Pairs whose
    prompt `encode` truncates (prompt + answer over `max_length`) are scored by `mean_token_nlls` itself.
    """
    was_training = model.training
    model.eval()
    task = progress.add_task(description, total=len(questions), status="") if progress is not None else None
    tick = (lambda n: progress.advance(task, n)) if task is not None else None
    try:
        if _takes_packed_rows(model, formatter):
            return _packed_nlls(model, formatter, questions, answers, batch_size, tick)
        return _cached_prefix_nlls(model, formatter, questions, answers, batch_size, tick)
    finally:
        model.train(was_training)


# Packed rows: a batch holds about this many tokens per `batch_size` (a TOFU forget question with its 7 answers
# is about 270 tokens packed; the cached path runs `batch_size` answer rows of about 40 tokens).
PACKED_TOKENS_PER_ROW = 48


Tick = Callable[[int], None] | None  # called with the number of questions each batch finished


@torch.no_grad()
def _packed_nlls(model, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
                 batch_size: int, tick: Tick = None) -> list[list[float]]:
    return _score_jobs(model, formatter, questions, answers, batch_size, _pack_and_score, tick)


def _pack_and_score(model, formatter: PromptFormatter, jobs: list[_Job], batch_size: int, device, result,
                    tick: Tick = None) -> None:
    """Questions sorted by packed length, in batches of about `batch_size` x PACKED_TOKENS_PER_ROW tokens."""
    trees = [_TokenTree(job) for job in jobs]
    order = sorted(range(len(trees)), key=lambda i: trees[i].length)
    budget = max(1, batch_size) * PACKED_TOKENS_PER_ROW
    batch: list[_TokenTree] = []
    for i in order:
        if batch and (len(batch) + 1) * trees[i].length > budget:
            _score_packed(model, batch, device, formatter.tokenizer.pad_token_id, result)
            if tick is not None:
                tick(len(batch))
            batch = []
        batch.append(trees[i])
    if batch:
        _score_packed(model, batch, device, formatter.tokenizer.pad_token_id, result)
        if tick is not None:
            tick(len(batch))


def _score_jobs(model, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
                batch_size: int, score, tick: Tick = None) -> list[list[float]]:
    """Both shared-prefix paths: `score` fills the values of every question's distinct, untruncated answers;
    the pairs `encode` truncates take `mean_token_nlls`, and identical answers copy the value computed once."""
    device = next(model.parameters()).device
    result: list[list[float]] = [[0.0] * len(group) for group in answers]
    jobs, leftovers = _shared_jobs(formatter, questions, answers)
    if tick is not None and len(jobs) < len(questions):  # questions with nothing to score by the shared prefix
        tick(len(questions) - len(jobs))
    score(model, formatter, jobs, batch_size, device, result, tick)
    if leftovers:
        values = mean_token_nlls(model, formatter, [(questions[q], answers[q][a]) for q, a in leftovers], batch_size)
        for (q, a), value in zip(leftovers, values):
            result[q][a] = value
    for job in jobs:
        for position, first in job.copies.items():
            result[job.question][position] = result[job.question][first]
    return result


class _TokenTree:
    """One question packed: its prompt, then one node per distinct answer prefix (a parent before its children).
    `paths[k]` lists the nodes of the k-th answer of `job.answers`; node u sits at position len(prompt) - 1 +
    depth(u), the position its token has in the answer's own sequence."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1: the prompt
        self.depths: list[int] = []
        self.paths: list[list[int]] = []
        children: dict[tuple[int, int], int] = {}
        for _, ids in job.answers:
            node, path = -1, []
            for token in ids:
                key = (node, token)
                if key not in children:
                    children[key] = len(self.tokens)
                    self.tokens.append(token)
                    self.parents.append(node)
                    self.depths.append(1 if node < 0 else self.depths[node] + 1)
                node = children[key]
                path.append(node)
            self.paths.append(path)
        self.length = len(job.prompt) + len(self.tokens)


def _score_packed(model, batch: list[_TokenTree], device, pad_id: int, result) -> None:
    """One forward over left-padded packed rows; each answer's mean NLL into `result[question][position]`."""
    width = max(tree.length for tree in batch)
    keep = 1 + max(len(tree.tokens) for tree in batch)
    count_tokens("teacher_forced", sum(tree.length for tree in batch))
    ids = torch.full((len(batch), width), pad_id if pad_id is not None else 0, dtype=torch.long)
    positions = torch.zeros((len(batch), width), dtype=torch.long)
    allowed = torch.zeros((len(batch), width, width), dtype=torch.bool)
    rows, columns, targets, answer_of = [], [], [], []
    n_answers = 0
    for r, tree in enumerate(batch):
        n_prompt, offset = len(tree.job.prompt), width - tree.length
        start = offset + n_prompt  # the first node's column
        ids[r, offset:] = torch.tensor(tree.job.prompt + tree.tokens)
        positions[r, offset:start] = torch.arange(n_prompt)
        positions[r, start:] = n_prompt - 1 + torch.tensor(tree.depths, dtype=torch.long)
        allowed[r, offset:start, offset:start] = torch.ones(n_prompt, n_prompt, dtype=torch.bool).tril()
        allowed[r, start:, offset:start] = True
        for u, parent in enumerate(tree.parents):  # a node sees its parent's context and itself
            if parent >= 0:
                allowed[r, start + u, start:] = allowed[r, start + parent, start:]
            allowed[r, start + u, start + u] = True
        for column in range(offset):  # padding sees itself only (no empty softmax row)
            allowed[r, column, column] = True
        # the logits kept are the last `keep` columns: the prompt's last token is column keep - 1 - len(tokens)
        last_prompt = keep - 1 - len(tree.tokens)
        for path in tree.paths:
            previous = last_prompt
            for node in path:
                rows.append(r)
                columns.append(previous)
                targets.append(tree.tokens[node])
                answer_of.append(n_answers)
                previous = keep + node - len(tree.tokens)
            n_answers += 1
    mask = allowed[:, None].to(device)
    if getattr(model.config, "_attn_implementation", None) == "eager":  # eager adds the mask to the scores
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    rows_t, columns_t = torch.tensor(rows, device=device), torch.tensor(columns, device=device)
    targets_t = torch.tensor(targets, device=device)
    split = _split_head(model)
    if split is not None:
        decoder, head = split
        hidden = decoder(input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device),
                         use_cache=False).last_hidden_state[:, -keep:]
        nll = _head_nlls(head, hidden, rows_t, columns_t, targets_t)
    else:
        logits = _forward_packed(model, ids.to(device), mask, positions.to(device), keep).logits  # [rows, keep, V]
        log_norm = torch.stack([torch.logsumexp(_upcast(row), dim=-1) for row in logits])  # [rows, keep]
        nll = log_norm[rows_t, columns_t] - _upcast(logits[rows_t, columns_t, targets_t])
    answer_t = torch.tensor(answer_of, device=device)
    sums = torch.zeros(n_answers, dtype=nll.dtype, device=device).index_add_(0, answer_t, nll)
    counts = torch.zeros(n_answers, dtype=nll.dtype, device=device).index_add_(0, answer_t, torch.ones_like(nll))
    means = (sums / counts).tolist()
    k = 0
    for tree in batch:
        for position, _ in tree.job.answers:
            result[tree.job.question][position] = means[k]
            k += 1


# The output layer runs on this many scored positions at a time: their logits (SmolLM2: 49,152 x 4 bytes each) stay
# in the CPU's cache for the log-normaliser, where a batch's whole [rows, keep, vocab] block (half a gigabyte for a
# TOFU batch) went out to memory and was read back.
HEAD_POSITIONS_PER_CHUNK = 64


def _head_nlls(head: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) for each scored (row, column, target), the output layer applied only at the distinct scored
    positions (no padding column, no column twice), HEAD_POSITIONS_PER_CHUNK positions at a time."""
    flat = rows * hidden.shape[1] + columns
    positions, inverse = torch.unique(flat, return_inverse=True)
    states = hidden.reshape(-1, hidden.shape[-1])[positions]
    log_norm = torch.empty(len(positions), dtype=torch.float32 if states.dtype != torch.float64 else states.dtype,
                           device=hidden.device)
    target_logit = torch.empty(len(targets), dtype=log_norm.dtype, device=hidden.device)
    order = torch.argsort(inverse)  # scored items grouped by position, so each chunk takes one slice of them
    bounds = torch.searchsorted(inverse[order], torch.arange(0, len(positions) + HEAD_POSITIONS_PER_CHUNK,
                                                              HEAD_POSITIONS_PER_CHUNK, device=hidden.device))
    for k, start in enumerate(range(0, len(positions), HEAD_POSITIONS_PER_CHUNK)):
        logits = _upcast(head(states[start:start + HEAD_POSITIONS_PER_CHUNK]))
        log_norm[start:start + HEAD_POSITIONS_PER_CHUNK] = torch.logsumexp(logits, dim=-1)
        items = order[bounds[k]:bounds[k + 1]]
        target_logit[items] = logits[inverse[items] - start, targets[items]]
    return log_norm[inverse] - target_logit


def _split_head(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, output layer) when the model's logits are exactly its output layer applied to its decoder's last
    hidden state (checked once per model on a probe), so scoring can apply the output layer where it needs logits;
    None otherwise (logit soft-capping or scaling, architectures without `get_decoder`)."""
    if not _checked_once(model, "_doplus_split_head", lambda: _head_probe(model)):
        return None
    return model.get_decoder(), model.get_output_embeddings()


def _head_probe(model) -> bool:
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Linear):
        return False
    ids = torch.arange(1, 9, device=next(model.parameters()).device)[None] % max(2, model.config.vocab_size)
    with torch.no_grad():
        logits = _upcast(model(input_ids=ids, use_cache=False).logits)
        split = _upcast(head(decoder(input_ids=ids, use_cache=False).last_hidden_state))
    return split.shape == logits.shape and bool(torch.allclose(split, logits, rtol=1e-4, atol=1e-4))


def _checked_once(model, attribute: str, probe: Callable[[], bool]) -> bool:
    """`probe()`'s verdict, kept on the model as `attribute` so each model is probed once; an error is a no."""
    verdict = getattr(model, attribute, None)
    if verdict is not None:
        return verdict
    try:
        verdict = bool(probe())
    except (AttributeError, TypeError, ValueError, RuntimeError, NotImplementedError):
        verdict = False
    try:
        setattr(model, attribute, verdict)
    except AttributeError:
        pass
    return verdict


def _forward_packed(model, input_ids, mask, position_ids, keep: int):
    inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}
    try:
        return model(**inputs, logits_to_keep=keep)
    except TypeError:  # an architecture without logits_to_keep
        output = model(**inputs)
        output.logits = output.logits[:, -keep:]
        return output


def _takes_packed_rows(model, formatter: PromptFormatter) -> bool:
    """Whether the model honours a custom 4D attention mask with explicit positions: its attention is
    transformers' sdpa or eager, and one packed question scores its two answers as two plain forwards do
    (checked once per model)."""
    def probe() -> bool:
        if getattr(getattr(model, "config", None), "_attn_implementation", None) not in ("sdpa", "eager"):
            return False
        probe_q, probe_a = ["Who wrote it?"], [["Nobody wrote it at all.", "Nobody knows it."]]
        packed = _packed_nlls(model, formatter, probe_q, probe_a, 1)[0]
        plain = mean_token_nlls(model, formatter, [(probe_q[0], a) for a in probe_a[0]], 1)
        return all(abs(x - y) <= 1e-3 * max(1.0, abs(y)) for x, y in zip(packed, plain))

    return _checked_once(model, "_doplus_packed_rows", probe)


@torch.no_grad()
def _cached_prefix_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
    batch_size: int = 16, tick: Tick = None,
) -> list[list[float]]:
    """`shared_prefix_nlls` for models without custom 4D masks: the prompts of a chunk of questions run once
    (left-padded); their KV cache is then expanded over the answers (any answer row may take any prompt row, so
    answers are packed by length across questions) and each answer runs on top of its prompt's cache. The first
    answer token is scored from the prompt's last logits, the others from the answer pass."""
    if not _shares_cache(model, formatter, next(model.parameters()).device):
        values = grouped_nlls(model, formatter, questions, answers, batch_size)
        if tick is not None:
            tick(len(questions))
        return values
    return _score_jobs(model, formatter, questions, answers, batch_size, _chunk_and_score, tick)


def _chunk_and_score(model, formatter: PromptFormatter, jobs: list[_Job], batch_size: int, device, result,
                     tick: Tick = None) -> None:
    """Questions sorted by prompt length, in chunks of about ANSWER_ROWS_PER_CHUNK x `batch_size` answers."""
    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i].prompt))
    chunk: list[_Job] = []
    for i in order:
        chunk.append(jobs[i])
        if sum(len(job.answers) for job in chunk) >= ANSWER_ROWS_PER_CHUNK * batch_size:
            _score_chunk(model, formatter, chunk, batch_size, device, result)
            if tick is not None:
                tick(len(chunk))
            chunk = []
    if chunk:
        _score_chunk(model, formatter, chunk, batch_size, device, result)
        if tick is not None:
            tick(len(chunk))


def _shares_cache(model, formatter: PromptFormatter, device) -> bool:
    """Whether the model hands back a KV cache that can be reordered (every transformers causal LM here does)."""
    ids = torch.tensor([[formatter.tokenizer.eos_token_id or 0]], device=device)
    cache = _forward(model, ids, torch.ones_like(ids), torch.zeros_like(ids), None, keep=1).past_key_values
    return cache is not None and hasattr(cache, "reorder_cache")


class _Job:
    """One question: its prompt ids and its distinct answers' ids, with where each value goes."""

    def __init__(self, question: int, prompt: list[int]) -> None:
        self.question = question
        self.prompt = prompt
        self.answers: list[tuple[int, list[int]]] = []  # (position in the question's group, answer ids)
        self.copies: dict[int, int] = {}  # position -> position of the identical answer that is scored


def _shared_jobs(formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]]):
    jobs, leftovers = [], []
    for q, (question, group) in enumerate(zip(questions, answers)):
        job = _Job(q, formatter.prompt_ids(question))
        seen: dict[str, int] = {}
        for a, answer in enumerate(group):
            if answer in seen:
                job.copies[a] = seen[answer]
                continue
            seen[answer] = a
            encoded = formatter.encode(question, answer)
            n_prompt = next((k for k, label in enumerate(encoded.labels) if label != IGNORE_INDEX),
                            len(encoded.labels))
            if encoded.input_ids[:n_prompt] != job.prompt or n_prompt == len(encoded.input_ids):
                leftovers.append((q, a))  # truncated by max_length: scored as a whole sequence
                continue
            job.answers.append((a, encoded.input_ids[n_prompt:]))
        if job.answers or job.copies:
            jobs.append(job)
    return jobs, leftovers


def _score_chunk(model, formatter: PromptFormatter, chunk: list[_Job], batch_size: int, device, result,
                 token_stats: bool = False) -> None:
    """Prompts of `chunk` once, then its answers by length in batches of `batch_size` rows. Stores each
    answer's mean NLL in `result[question][position]`, or with `token_stats` its per-token statistics."""
    import copy

    pad_id = formatter.tokenizer.pad_token_id
    prompts = [Encoded(job.prompt, [IGNORE_INDEX] * len(job.prompt)) for job in chunk]
    count_tokens("teacher_forced", sum(len(job.prompt) + sum(len(ids) for _, ids in job.answers) for job in chunk))
    batch = {k: v.to(device) for k, v in left_padded(prompts, pad_id).items()}
    output = _forward(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], None, keep=1)
    cache, first_log_probs = output.past_key_values, torch.log_softmax(_upcast(output.logits[:, -1]), dim=-1)
    prompt_mask, prompt_lengths = batch["attention_mask"], batch["attention_mask"].sum(-1)
    rows = [(row, position, ids) for row, job in enumerate(chunk) for position, ids in job.answers]
    rows.sort(key=lambda r: len(r[2]))
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        index = torch.tensor([row for row, _, _ in part], device=device)
        width = max(len(ids) for _, _, ids in part)
        ids = torch.full((len(part), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(part), width), dtype=torch.long, device=device)
        for r, (_, _, answer) in enumerate(part):
            ids[r, :len(answer)] = torch.tensor(answer, device=device)
            mask[r, :len(answer)] = 1
        answer_cache = copy.deepcopy(cache)
        answer_cache.reorder_cache(index)
        positions = prompt_lengths[index, None] + torch.arange(width, device=device)
        full_mask = torch.cat([prompt_mask[index], mask], dim=1)
        logits = _forward(model, ids, full_mask, positions, answer_cache).logits
        log_probs = torch.log_softmax(_upcast(logits[:, :-1]), dim=-1)
        if token_stats:
            vocab = torch.cat([first_log_probs[index][:, None], log_probs], dim=1)  # [rows, width, V]
            for r, (row, position, answer) in enumerate(part):
                result[chunk[row].question][position] = per_token_stats(vocab[r, :len(answer)], answer)
            continue
        first = first_log_probs[index].gather(-1, ids[:, :1]).squeeze(-1)
        rest = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        counts = mask.sum(-1)
        means = (-(first + rest.sum(-1)) / counts).tolist()
        for (row, position, _), value in zip(part, means):
            result[chunk[row].question][position] = value


def per_token_stats(log_probs: torch.Tensor, answer: list[int]) -> dict[str, list]:
    """Per answer token t: log p(x_t), mu_t = sum_v p(v) log p(v), s2_t = sum_v p(v) log^2 p(v) - mu_t^2, and the
    greedy prediction argmax_v p(v) (float64 arithmetic)."""
    log_probs = log_probs.double()
    probs = log_probs.exp()
    means = (probs * log_probs).sum(-1)
    variances = (probs * log_probs.square()).sum(-1) - means.square()
    target = torch.tensor(answer, device=log_probs.device)
    return {"token_log_probs": log_probs.gather(-1, target[:, None]).squeeze(-1).tolist(),
            "means": means.tolist(), "variances": variances.tolist(),
            "predicted": log_probs.argmax(-1).tolist(), "labels": list(answer)}


@torch.no_grad()
def answer_token_stats(
    model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]], batch_size: int = 16,
) -> list[dict[str, list]]:
    """For each (question, answer): its scored tokens' statistics (see `per_token_stats`) and `text`, the scored
    tokens decoded without special tokens, from the prompt's cache as in `shared_prefix_nlls`. A pair whose
    prompt `encode` truncates is scored with the truncated prompt as its own prefix."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    result: list[list] = [[None] for _ in pairs]
    jobs = []
    for q, (question, answer) in enumerate(pairs):
        encoded = formatter.encode(question, answer)
        n_prompt = next((k for k, label in enumerate(encoded.labels) if label != IGNORE_INDEX), len(encoded.labels))
        job = _Job(q, encoded.input_ids[:n_prompt])
        job.answers.append((0, encoded.input_ids[n_prompt:]))
        if n_prompt == 0 or n_prompt == len(encoded.input_ids):
            raise ValueError(f"answer_token_stats: pair {q} has no prompt or no answer tokens after truncation")
        jobs.append(job)
    try:
        order = sorted(range(len(jobs)), key=lambda i: len(jobs[i].prompt))
        step = ANSWER_ROWS_PER_CHUNK * batch_size
        for start in range(0, len(order), step):
            _score_chunk(model, formatter, [jobs[i] for i in order[start:start + step]], batch_size,
                         device, result, token_stats=True)
    finally:
        model.train(was_training)
    stats = [r[0] for r in result]
    for item in stats:
        item["text"] = formatter.tokenizer.decode(item["labels"], skip_special_tokens=True)
    return stats


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _forward(model, input_ids, attention_mask, position_ids, cache, keep: int | None = None):
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": True}
    if cache is not None:
        inputs["past_key_values"] = cache
    return forward_keeping(model, keep, **inputs)


def forward_keeping(model, keep: int | None, **inputs):
    """`model(**inputs)` with the logits of the last `keep` positions only, where the architecture takes
    `logits_to_keep` (all positions otherwise, and with `keep` None)."""
    if keep is not None:
        try:
            return model(**inputs, logits_to_keep=keep)
        except TypeError:  # an architecture without logits_to_keep
            pass
    return model(**inputs)
