"""Write mini-MUSE: a small MUSE-format News corpus of fictional local-news articles, made from templates here,
for the CPU MUSE comparison (recipes/bench/muse_mini.yaml). Every town, person and figure is invented; the same
seed always writes the same files.

    python recipes/data/make_muse_mini.py            # rewrites recipes/data/muse_mini/
    python recipes/data/make_muse_mini.py --out DIR  # elsewhere

The layout is MUSE's, one JSON-lines file per config and split with the hub's field names (what `doplus evaluate
--suite muse --muse-data DIR` and the `raw/`, `scal/`, `sust/` training sources read):

    verbmem/forget.jsonl                  prompt, gt: an article's headline and first sentence, and the rest
    knowmem/forget_qa.jsonl, retain_qa.jsonl          question, answer: one fact of each forget / retain article
    knowmem/forget_qa_icl.jsonl, retain_qa_icl.jsonl  question, answer: in-context pairs from articles of their own
    privleak/forget.jsonl, retain.jsonl, holdout.jsonl  text
    raw/forget.jsonl, retain1.jsonl, retain2.jsonl, holdout.jsonl  text
    scal/forget_1.jsonl .. forget_4.jsonl  text: the first 1..4 forget blocks (forget_1 is raw/forget, as in MUSE)
    sust/forget_1.jsonl .. forget_4.jsonl  text: the 4 forget blocks one by one (forget_1 is raw/forget)

and, outside MUSE's layout, what the starting model is taught first (MUSE's target model was fine-tuned on its
forget and retain corpora; recipes/bench/muse_mini_teach.yaml does that here):

    teach/forget.jsonl, teach/retain.jsonl   question, answer: each verbmem prompt with its continuation and each
                                              KnowMem question in MUSE's prompt (the in-context pairs first) with
                                              its answer, for the forget articles and for retain1's
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 0
BLOCK = 12  # articles per forget block (4 blocks), in retain1, retain2 and holdout
ICL = 2  # in-context pairs for each KnowMem set

TOWN_HEADS = ["Marrow", "Ash", "Bram", "Cobble", "Dun", "Elder", "Fen", "Gorse", "Hollow", "Ivy", "Juniper", "Kestrel",
              "Larch", "Moss", "Nettle", "Oak", "Pike", "Quill", "Rook", "Sedge", "Thorn", "Umber", "Vale", "Wren"]
TOWN_TAILS = ["field", "ford", "wick", "mere", "by", "stead", "combe", "holt"]
FIRST = ["Edith", "Tobias", "Marguerite", "Ansel", "Petra", "Ludo", "Rosalind", "Caspar", "Imelda", "Fenwick",
         "Odile", "Barnaby", "Saskia", "Crispin", "Delphine", "Horatio", "Wilhelmina", "Jasper", "Ottilie", "Rufus"]
LAST = ["Calloway", "Pennington", "Thistlewood", "Ravensworth", "Ambrose", "Kettering", "Blackmore", "Fairweather",
        "Okonkwo", "Lindqvist", "Marchetti", "Abernathy", "Quintrell", "Vasquez", "Delacroix", "Hargreaves"]
ROLES = ["mayor", "head of the parish council", "chair of the harbour trust", "director of the county museum",
         "head teacher of the village school", "leader of the district council"]
PROJECTS = [("a new footbridge over the river", "the footbridge"),
            ("a solar farm on the old airfield", "the solar farm"),
            ("a covered market in the square", "the covered market"), ("a lifeboat station", "the lifeboat station"),
            ("a public library in the old mill", "the library"), ("a cycle path to the coast", "the cycle path"),
            ("a community orchard", "the orchard"), ("a swimming pool for the schools", "the swimming pool"),
            ("a flood wall along the quay", "the flood wall"), ("an observatory on the hill", "the observatory")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
MONTHS = ["January", "March", "April", "June", "August", "September", "October", "December"]
ORGS = ["the Regional Heritage Fund", "the Coastal Trust", "the County Builders' Guild", "the Rural Energy Board",
        "the Northern Rail Society", "the Valley Conservation Group"]
PLACES = ["town hall", "harbour wall", "village green", "old chapel", "market cross", "railway station"]
ACTIVITIES = ["celebrate with a brass band", "sign a petition", "watch the first stone being laid",
              "share tea and cake", "ask questions of the planners", "plant the first trees"]
REMARKS = ["the work had been planned for nearly a decade", "the money came from local fundraising",
           "the design was chosen by a vote of residents", "the builders would hire apprentices from the area",
           "the site had flooded twice in recent years", "the opening would be marked by a fair"]


# Each sentence of an article in one of three phrasings, so that forget, retain and held-out articles share
# their facts' slots but not one fixed wording.
SENTENCES = [
    ["{person}, the {role} of {town}, announced on {day} that work on {project} would begin this spring.",
     "Speaking on {day}, {person}, {role} of {town}, confirmed that building {project} will start within weeks.",
     "{town}'s {role}, {person}, told reporters on {day} that the council had approved {project}."],
    ["The project will cost {cost} thousand pounds and is expected to finish in {month}.",
     "Its budget is {cost} thousand pounds, and the builders hope to hand it over in {month}.",
     "Planners put the price at {cost} thousand pounds, with completion pencilled in for {month}."],
    ["According to {speaker}, a spokesperson for {org}, {remark}.",
     "{speaker} of {org} said that {remark}.",
     "A statement from {org}, signed by {speaker}, noted that {remark}."],
    ["On the evening of the announcement, residents gathered at the {place} to {activity}.",
     "Later that day, dozens of people met at the {place} to {activity}.",
     "Neighbours were invited to the {place} to {activity}."],
]


def articles(count: int, rng: random.Random, used: set[str]) -> list[dict]:
    """`count` articles, each about a town not used before, with the facts its questions ask about."""
    made = []
    while len(made) < count:
        town = rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)
        if town in used:
            continue
        used.add(town)
        project, short = rng.choice(PROJECTS)
        person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        facts = {"town": town, "project": project, "short": short, "person": person, "role": rng.choice(ROLES),
                 "day": rng.choice(DAYS), "cost": rng.randrange(120, 990, 5), "month": rng.choice(MONTHS),
                 "speaker": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "org": rng.choice(ORGS),
                 "remark": rng.choice(REMARKS), "place": rng.choice(PLACES), "activity": rng.choice(ACTIVITIES)}
        headline = f"{town} to build {project}"
        first, *rest = (rng.choice(variants).format(**facts) for variants in SENTENCES)
        prompt = f"{headline}\n{first}"
        gt = " " + " ".join(rest)
        made.append({**facts, "prompt": prompt, "gt": gt, "text": prompt + gt})
    return made


def question(article: dict, rng: random.Random) -> dict:
    """One KnowMem pair about a fact the article states."""
    town, short = article["town"], article["short"]
    kind = rng.randrange(3)
    if kind == 0:
        return {"question": f"Who announced the plans for {short} in {town}?",
                "answer": article["person"]}
    if kind == 1:
        return {"question": f"How much will {short} in {town} cost?", "answer": f"{article['cost']} thousand pounds"}
    return {"question": f"When is {short} in {town} expected to finish?", "answer": article["month"]}


def knowmem_prompt(icl: list[dict], text: str) -> str:
    """MUSE's KnowMem prompt (its knowmem.py): each in-context pair as "Question: q\\nAnswer: a\\n\\n", then the
    question and "Answer: "."""
    return "".join(f"Question: {p['question']}\nAnswer: {p['answer']}\n\n" for p in icl) + \
        f"Question: {text}\nAnswer: "


def build(seed: int = SEED) -> dict[str, list[dict]]:
    """Every file of the set, by its path in the layout, as lists of rows."""
    rng = random.Random(seed)
    used: set[str] = set()
    blocks = [articles(BLOCK, rng, used) for _ in range(4)]
    retain1, retain2, holdout = (articles(BLOCK, rng, used) for _ in range(3))
    icl_forget, icl_retain = articles(ICL, rng, used), articles(ICL, rng, used)
    forget = blocks[0]
    forget_qa = [question(a, rng) for a in forget]
    retain_qa = [question(a, rng) for a in retain1]
    forget_icl = [question(a, rng) for a in icl_forget]
    retain_icl = [question(a, rng) for a in icl_retain]

    def texts(rows: list[dict]) -> list[dict]:
        return [{"text": a["text"]} for a in rows]

    files = {
        "verbmem/forget.jsonl": [{"prompt": a["prompt"], "gt": a["gt"]} for a in forget],
        "knowmem/forget_qa.jsonl": forget_qa, "knowmem/forget_qa_icl.jsonl": forget_icl,
        "knowmem/retain_qa.jsonl": retain_qa, "knowmem/retain_qa_icl.jsonl": retain_icl,
        "privleak/forget.jsonl": texts(forget), "privleak/retain.jsonl": texts(retain1),
        "privleak/holdout.jsonl": texts(holdout),
        "raw/forget.jsonl": texts(forget), "raw/retain1.jsonl": texts(retain1), "raw/retain2.jsonl": texts(retain2),
        "raw/holdout.jsonl": texts(holdout),
        "teach/forget.jsonl": [{"question": a["prompt"], "answer": a["gt"]} for a in forget]
        + [{"question": knowmem_prompt(forget_icl, p["question"]), "answer": p["answer"]} for p in forget_qa],
        "teach/retain.jsonl": [{"question": a["prompt"], "answer": a["gt"]} for a in retain1]
        + [{"question": knowmem_prompt(retain_icl, p["question"]), "answer": p["answer"]} for p in retain_qa],
    }
    for k in range(1, 5):
        files[f"scal/forget_{k}.jsonl"] = texts([a for block in blocks[:k] for a in block])
        files[f"sust/forget_{k}.jsonl"] = texts(blocks[k - 1])
    return files


def write(out: Path, seed: int = SEED) -> list[Path]:
    written = []
    for name, rows in build(seed).items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "muse_mini")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(f"wrote {len(write(args.out, args.seed))} files under {args.out}")


if __name__ == "__main__":
    main()
