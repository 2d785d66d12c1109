"""The project's own "I don't know" answers: targets for IDK and DPO, the dispreferred answer for AP.

Written for doplus (not copied from any dataset): 60 phrasings that vary in length, register and reason
given, so a model trained on them learns to decline rather than to repeat one fixed sentence.
"""

from __future__ import annotations

import random

REJECTIONS: tuple[str, ...] = (
    "I don't know.",
    "I'm not sure about that.",
    "I don't have that information.",
    "I can't answer that question.",
    "That's something I don't know.",
    "I have no idea, to be honest.",
    "I'm afraid I can't help with that one.",
    "I don't have any details about that.",
    "Sorry, I don't know the answer.",
    "I'm not able to answer that.",
    "I couldn't tell you.",
    "That isn't something I know about.",
    "I don't have reliable information on that.",
    "I'm unable to provide an answer to that question.",
    "I really don't know.",
    "Unfortunately, I don't know.",
    "I'm not familiar with that.",
    "I have no knowledge of that.",
    "That's beyond what I know.",
    "I can't say.",
    "I'm drawing a blank on that one.",
    "I don't have an answer for you.",
    "I wish I could help, but I don't know.",
    "I'm not certain, so I'd rather not guess.",
    "I don't know enough to answer that.",
    "That's outside my knowledge.",
    "I'm sorry, but I have no information about that.",
    "I can't recall anything about that.",
    "I'd be guessing, and I don't want to mislead you.",
    "I don't know anything about that topic.",
    "No idea, I'm afraid.",
    "I'm not in a position to answer that.",
    "That's not something I can answer.",
    "I lack the information needed to answer.",
    "I'm unsure; I don't have those details.",
    "I don't have the knowledge to respond to that.",
    "Honestly, I can't answer that.",
    "I'm not aware of the answer.",
    "I don't have data on that.",
    "I can't provide that information.",
    "That question is one I can't answer.",
    "Sorry, that's not something I know.",
    "I have nothing reliable to say about that.",
    "I don't know the details of that.",
    "I'm not the right source for that answer.",
    "I can't give you an answer to that.",
    "I don't remember anything about that.",
    "It's not something I have information about.",
    "I'm sorry, I can't answer that question.",
    "I'm not knowledgeable about that.",
    "I'd rather not answer, since I don't know.",
    "That's a mystery to me.",
    "I have no clue.",
    "I can't help you with that, I'm afraid.",
    "I don't possess that information.",
    "There's nothing I can tell you about that.",
    "I'm not sure, and I don't want to make something up.",
    "I'm unable to answer; I simply don't know.",
    "That's not within what I know.",
    "I'm sorry, I have no answer to that.",
)


def rejection_for(index: int, seed: int = 0) -> str:
    """A rejection answer for sample `index`: fixed for a given (index, seed), varied across samples."""
    return random.Random(seed * 1_000_003 + index).choice(REJECTIONS)
