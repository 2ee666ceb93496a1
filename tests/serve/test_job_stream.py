"""A job's events cross from the scheduler's thread to the request's event loop: step by step when streamed, in
one hand-over when the answer is one body (the event loop then wakes once per request, not once per step)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tinylm.serve.jobs import ChoiceEvent, JobDone, JobFailed
from tinylm.serve.responses import JobStream


def handed_over(whole: bool, steps: list[list]) -> list[list]:
    """What the event loop's queue received, hand-over by hand-over, for events pushed step by step."""

    async def run() -> list[list]:
        stream = JobStream(SimpleNamespace(), whole=whole)
        for events in steps:
            stream.push(events)
        await asyncio.sleep(0)  # let call_soon_threadsafe's callbacks run
        return [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]

    return asyncio.run(run())


def steps_of(last) -> list[list]:
    return [[ChoiceEvent(0, "a")], [ChoiceEvent(0, "b")], [ChoiceEvent(0, "c", finish_reason="stop"), last]]


def test_a_streamed_job_hands_over_every_step():
    steps = steps_of(JobDone())
    assert handed_over(False, steps) == steps


def test_a_whole_answer_is_handed_over_once_when_its_job_ends():
    steps = steps_of(JobDone())
    assert handed_over(True, steps) == [[event for events in steps for event in events]]


def test_a_failure_ends_a_whole_answer_too_with_what_came_before():
    failure = JobFailed("out of memory", 500)
    (only,) = handed_over(True, [[ChoiceEvent(0, "a")], [failure]])
    assert only == [ChoiceEvent(0, "a"), failure]
    assert handed_over(True, [[ChoiceEvent(0, "a")]]) == []  # nothing crosses while the job runs
