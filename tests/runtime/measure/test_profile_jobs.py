"""The profiler's generate job runs a decode as a rollout does: every row's end checked every step (a rollout
checks its EOS; the job gives each row its length, so every row still decodes `response_len` tokens)."""

import pytest

torch = pytest.importorskip("torch")

from hybridflow.runtime.engines.rollout.generation import GenerationEngine  # noqa: E402
from hybridflow.runtime.measure import profiling  # noqa: E402
from hybridflow.simulator.vocabulary.parallel import ParallelConfig  # noqa: E402
from hybridflow.tools.commands.profile import GRID_MODELS  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_generate_point_checks_every_rows_end_and_decodes_the_whole_length(monkeypatch, one_rank_group):
    seen = []
    real = GenerationEngine.generate

    def recording(self, prompt_ids, attention_mask=None, params=None, generator=None, lengths=None):
        out = real(self, prompt_ids, attention_mask, params, generator, lengths)
        seen.append((lengths, out.response_mask.sum(1).tolist(), self.last_batch_sizes))
        return out

    monkeypatch.setattr(GenerationEngine, "generate", recording)
    # rank 0 of a dp layout: its own local model, its share of the rows
    job = {"op": "generate", "model": GRID_MODELS["p64"].model_dump(), "parallel": {"dp": 2}, "batch": 6,
           "prompt_len": 5, "response_len": 7}
    seconds, _, _ = profiling._job_generate(0, ParallelConfig(dp=2), job, 0, 2)
    assert seconds > 0 and len(seen) == 2
    for lengths, made, batch_sizes in seen:
        assert lengths is not None and lengths.tolist() == [7, 7, 7]  # the end-of-row path, as a rollout's
        assert made == [7, 7, 7] and batch_sizes == [3] * 6  # no row ends early: the point's steps are all taken
