"""The Publisher under the bulletin's step rule: the latest step again with the same weights is that
version (nothing new, the publisher goes on from it); with other weights it is refused and the
publisher's state stays at the last version."""

from __future__ import annotations

import pytest

from stitchboard.bulletin.errors import VersionConflictError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of


def test_the_same_step_again(bulletin, run):
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run) as pub:
        assert pub.publish(trainer.model, step=0).version == 0
        trainer.step()
        assert pub.publish(trainer.model, step=1).version == 1
        again = pub.publish(trainer.model, step=1)  # a trainer restarted from its step-1 checkpoint
        assert (again.version, again.changed_elements, pub.last_version) == (1, 0, 1)
        assert [i.version for i in pub.client.versions(run)] == [0, 1]

        trainer.step()  # other weights under the same step
        with pytest.raises(VersionConflictError, match="step 1 of run .* is version 1; version 2 records step 1"):
            pub.publish(trainer.model, step=1)
        assert pub.last_version == 1
        assert pub.publish(trainer.model, step=2).version == 2
        assert_same_view(rebuild_version(pub.client, run, 2).view, view_of(trainer.model))
        assert pub.client.version_for_step(run, 2).version == 2
