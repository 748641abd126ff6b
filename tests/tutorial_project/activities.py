"""A user's tool activity."""

from temporalio import activity


@activity.defn
async def count_words(text: str) -> int:
    return len(text.split())
