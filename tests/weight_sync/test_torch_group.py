"""The torch transport's group when a member leaves, dies, or comes too late, through real
process groups (gloo): the group breaks for good, the publisher goes on publishing (the versions
the group held are released, every later one at once, so a one-slot publisher is never stuck),
and every member still there is told why by `WeightSyncError`, keeping its version."""

from __future__ import annotations

import logging

from weight_sync import TorchTransport, WeightPublisher

from .harness import Subscribers, check
from .workers import BUCKET, kill, weights


def _two_members_on_version_1() -> tuple[WeightPublisher, Subscribers, Subscribers]:
    """A one-slot publisher and its group of two member processes, both holding version 1."""
    pub = WeightPublisher(
        None, transport=TorchTransport(world_size=3), bucket_bytes=BUCKET, slots=1, timeout=10, delta=False
    )
    try:
        members = Subscribers(1, pub.endpoint, "torch"), Subscribers(1, pub.endpoint, "torch", first_id=1)
        pub.publish(weights(1), 1)
        for member in members:
            member.wait_applied(1)
    except BaseException:
        pub.close()
        raise
    return pub, *members


def _told(subs: Subscribers, why: str) -> None:
    """`subs` saw errors (`wait_errors` before), every one a `WeightSyncError` saying `why`, and
    each kept version 1, exactly."""
    (summary,) = subs.finish().values()
    assert summary["errors"] and all(why in e for e in summary["errors"]), summary["errors"]
    assert summary["applied"] == [1]
    check(summary, 1)


def test_a_member_that_leaves_breaks_the_group_and_the_others_are_told(caplog):
    """Of two members, one closes after version 1: the publisher publishes 2..4 with one slot
    (none waits for a slot the group holds), and the other member's poll raises, saying the
    member left; its tensors stay exactly version 1."""
    caplog.set_level(logging.ERROR, logger="sluice.weight_sync")
    pub, stay, leave = _two_members_on_version_1()
    try:
        (left,) = leave.finish().values()
        check(left, 1)
        for version in (2, 3, 4):
            pub.publish(weights(version), version)
        stay.wait_errors()
        _told(stay, "left it")
        assert any("weight sync over torch stopped" in r.getMessage() for r in caplog.records)
    finally:
        pub.close()


def test_a_member_killed_breaks_the_group_and_publishing_goes_on():
    """A member is SIGKILLed after version 1: the broadcast of 2 fails, the publisher (one
    slot) publishes 3..5 without waiting, and the other member's poll raises within the wait
    below, keeping version 1."""
    pub, survivor, victim = _two_members_on_version_1()
    try:
        kill(victim.procs[0])
        for version in range(2, 6):
            pub.publish(weights(version), version)
        survivor.wait_errors()
        _told(survivor, "the torch group broke")
    finally:
        pub.close()


def test_a_subscriber_that_comes_after_the_group_gave_up_forming_is_told():
    """The publisher waits 1 s for its one member, which is not there: the version it held for
    the group is released (a one-slot publisher publishes the next), and the subscriber that
    comes later is told the group never formed and that it joined after that."""
    pub = WeightPublisher(
        None, transport=TorchTransport(world_size=2, timeout=1), bucket_bytes=BUCKET, slots=1, timeout=10
    )
    try:
        pub.publish(weights(1), 1)
        pub.publish(weights(2), 2)  # its slot is 1's: free once the group gave up forming
        late = Subscribers(1, pub.endpoint, "torch")
        late.wait_errors()
        (summary,) = late.finish().values()
        assert summary["applied"] == [] and summary["final"] == -1, summary
        assert summary["errors"] and all(
            "never formed: 0 of its 1 subscriber(s) joined" in e and "joined after that" in e for e in summary["errors"]
        ), summary["errors"]
    finally:
        pub.close()


def test_a_subscriber_that_comes_after_the_group_formed_is_told_and_the_group_goes_on():
    """A group of one member formed and took version 1; a second subscriber is told it came
    after the group formed, and its leaving does not break the group: the member takes 2."""
    pub = WeightPublisher(None, transport=TorchTransport(world_size=2), bucket_bytes=BUCKET, delta=False)
    member = Subscribers(1, pub.endpoint, "torch")
    try:
        pub.publish(weights(1), 1)
        member.wait_applied(1)
        late = Subscribers(1, pub.endpoint, "torch", first_id=1)
        late.wait_errors()
        (summary,) = late.finish().values()
        assert summary["applied"] == [] and summary["final"] == -1, summary
        assert summary["errors"] and all(
            "formed with its 2 members before this subscriber joined" in e for e in summary["errors"]
        ), summary["errors"]
        pub.publish(weights(2), 2)
        member.wait_applied(2)
        (kept,) = member.finish().values()
        assert kept["applied"] == [1, 2]
        check(kept, 2)
    finally:
        pub.close()
