"""RolloutDataSource(WithBuffer): index assignment, epoch wrap + reshuffle, FIFO buffer, save/load incl. the buffer."""

import json
import os

import pytest

from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer, pop_first
from slime.utils.types import Sample
from tests._args import make_args as real_args

NUM_PROMPTS = 5


def pop_last(args, rollout_id, buffer, num_samples):
    """A custom buffer filter (LIFO), loaded by path."""
    taken = []
    while buffer and len(taken) < num_samples:
        taken.append(buffer.pop())
    return taken


def greedy_filter(args, rollout_id, buffer, num_samples):
    """A broken buffer filter: returns more groups than asked for."""
    return list(buffer) + list(buffer)


@pytest.fixture(scope="module")
def prompt_file(tiny_kit, tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(NUM_PROMPTS):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+0?"}], "label": str(i)}) + "\n")
    return str(path)


def make_args(tiny_kit, prompt_file, **overrides):
    base = dict(
        rollout_global_dataset=True,
        prompt_data=prompt_file,
        hf_checkpoint=tiny_kit[0],
        rollout_max_prompt_len=None,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=True,
        rollout_seed=42,
        rollout_shuffle=False,
        n_samples_per_prompt=2,
        buffer_filter_path=None,
        dump_details=None,
        save=None,
        load=None,
    )
    base.update(overrides)
    return real_args(**base)


def labels(groups):
    return [g[0].label for g in groups]


def test_index_assignment_and_independent_copies(tiny_kit, prompt_file):
    ds = RolloutDataSource(make_args(tiny_kit, prompt_file, n_samples_per_prompt=3))
    groups = ds.get_samples(2) + ds.get_samples(1)
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [[s.group_index for s in g] for g in groups] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert labels(groups) == ["0", "1", "2"]
    # the chat template was applied: a text prompt ending in the generation prompt
    assert isinstance(groups[0][0].prompt, str) and groups[0][0].prompt.endswith("<|im_start|>assistant\n")
    assert all(s.prompt == groups[0][0].prompt for s in groups[0])
    groups[0][0].metadata["touched"] = True
    groups[0][0].tokens.append(1)
    assert groups[0][1].metadata == {} and groups[0][1].tokens == []  # deep copies, not aliases
    assert ds.dataset.samples[0].metadata == {}
    assert len(ds) == NUM_PROMPTS


def test_epoch_wrap_without_shuffle(tiny_kit, prompt_file):
    ds = RolloutDataSource(make_args(tiny_kit, prompt_file, n_samples_per_prompt=1))
    assert labels(ds.get_samples(3)) == ["0", "1", "2"]
    assert labels(ds.get_samples(3)) == ["3", "4", "0"]
    assert (ds.epoch_id, ds.sample_offset) == (1, 1)
    assert labels(ds.get_samples(4)) == ["1", "2", "3", "4"]  # exactly to the end: the epoch does not advance yet
    assert (ds.epoch_id, ds.sample_offset) == (1, 5)
    # more than a dataset's worth in one call: from the end of epoch 1, fills epochs 2 and 3 and begins epoch 4
    assert labels(ds.get_samples(11)) == ["0", "1", "2", "3", "4"] * 2 + ["0"]
    assert (ds.epoch_id, ds.sample_offset, ds.sample_index) == (4, 1, 21)


def test_epoch_reshuffle(tiny_kit, prompt_file):
    args = make_args(tiny_kit, prompt_file, n_samples_per_prompt=1, rollout_shuffle=True)
    ds = RolloutDataSource(args)
    epochs = [labels(ds.get_samples(NUM_PROMPTS)) for _ in range(4)]
    for order in epochs:  # every epoch visits every prompt exactly once
        assert sorted(order) == [str(i) for i in range(NUM_PROMPTS)]
    assert len({tuple(o) for o in epochs}) > 1, f"the order never changed across epochs: {epochs}"
    # the same seed gives the same orders; a different seed does not
    again = RolloutDataSource(args)
    assert [labels(again.get_samples(NUM_PROMPTS)) for _ in range(4)] == epochs
    other = RolloutDataSource(
        make_args(tiny_kit, prompt_file, n_samples_per_prompt=1, rollout_shuffle=True, rollout_seed=7)
    )
    assert [labels(other.get_samples(NUM_PROMPTS)) for _ in range(4)] != epochs


def test_without_dataset_yields_empty_samples(tiny_kit):
    args = make_args(tiny_kit, None, rollout_global_dataset=False, prompt_data=None)
    ds = RolloutDataSourceWithBuffer(args)
    groups = ds.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert all(s.prompt == "" and s.tokens == [] for g in groups for s in g)
    ds.save(0)  # no global dataset: nothing to save, and no --save needed


def test_read_only_source_rejects_samples(tiny_kit, prompt_file):
    with pytest.raises(RuntimeError, match="read-only"):
        RolloutDataSource(make_args(tiny_kit, prompt_file)).add_samples([[Sample(), Sample()]])


def test_buffer_is_fifo_then_dataset(tiny_kit, prompt_file):
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file))
    g1 = [Sample(index=100, label="a"), Sample(index=101, label="a")]
    g2 = [Sample(index=102, label="b"), Sample(index=103, label="b")]
    ds.add_samples([g1])
    ds.add_samples([g2])
    ds.add_samples([])  # no-op
    assert ds.get_buffer_length() == 2
    first = ds.get_samples(1)
    assert first == [g1] and first[0] is g1
    rest = ds.get_samples(3)
    assert rest[0] is g2 and labels(rest) == ["b", "0", "1"]
    assert [s.index for s in rest[1]] == [0, 1]  # fresh prompts keep their own global index sequence
    assert ds.get_buffer_length() == 0


def test_pop_first():
    buffer = [[Sample(index=i)] for i in range(3)]
    assert [g[0].index for g in pop_first(None, None, buffer, 2)] == [0, 1]
    assert [g[0].index for g in buffer] == [2]
    assert [g[0].index for g in pop_first(None, None, buffer, 5)] == [2] and buffer == []


def test_custom_buffer_filter_by_path(tiny_kit, prompt_file):
    ds = RolloutDataSourceWithBuffer(
        make_args(
            tiny_kit, prompt_file, n_samples_per_prompt=1, buffer_filter_path="tests.test_rollout_data_source.pop_last"
        )
    )
    ds.add_samples([[Sample(index=i)] for i in (10, 11, 12)])
    assert [g[0].index for g in ds.get_samples(2)] == [12, 11]

    bad = RolloutDataSourceWithBuffer(
        make_args(
            tiny_kit,
            prompt_file,
            n_samples_per_prompt=1,
            buffer_filter_path="tests.test_rollout_data_source.greedy_filter",
        )
    )
    bad.add_samples([[Sample()], [Sample()]])
    with pytest.raises(
        ValueError,
        match="--buffer-filter-path 'tests.test_rollout_data_source.greedy_filter' must return a list of at most 1 groups",
    ):
        bad.get_samples(1)


def test_add_samples_validates_shape(tiny_kit, prompt_file):
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, n_samples_per_prompt=2))
    with pytest.raises(ValueError, match="group 1 has 3 samples.*--n-samples-per-prompt=2"):
        ds.add_samples([[Sample(), Sample()], [Sample(), Sample(), Sample()]])
    with pytest.raises(TypeError, match=r"list of groups \(list\[list\[Sample\]\]\), got list of Sample"):
        ds.add_samples([Sample(), Sample()])
    with pytest.raises(TypeError, match="group 0 contains something that is not a Sample"):
        ds.add_samples([[Sample(), {"index": 1}]])
    assert ds.get_buffer_length() == 0  # nothing half-added


def test_save_load_round_trip_with_buffer(tiny_kit, prompt_file, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    args = make_args(tiny_kit, prompt_file, rollout_shuffle=True, save=save_dir)
    ds = RolloutDataSourceWithBuffer(args)
    ds.get_samples(4)  # into epoch 0 ...
    ds.get_samples(3)  # ... and across the boundary into epoch 1
    partial = [
        Sample(
            index=50,
            label="p",
            tokens=[1, 2, 3],
            response="x",
            response_length=1,
            rollout_log_probs=[-0.5],
            status=Sample.Status.ABORTED,
            metadata={"start_rollout_id": 2},
        ),
        Sample(index=51, label="p"),
    ]
    ds.add_samples([partial])
    ds.update_metadata({"note": "kept"})
    ds.save(6)

    path = os.path.join(save_dir, "rollout", "global_dataset_state_dict_6.pt")
    assert os.path.exists(path)
    assert os.listdir(os.path.dirname(path)) == ["global_dataset_state_dict_6.pt"]  # no temp file left behind

    resumed = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, rollout_shuffle=True, load=save_dir))
    resumed.load(6)
    assert (resumed.epoch_id, resumed.sample_offset, resumed.sample_index) == (
        ds.epoch_id,
        ds.sample_offset,
        ds.sample_index,
    )
    assert resumed.get_metadata() == {"note": "kept"}
    assert resumed.get_buffer_length() == 1
    restored = resumed.buffer[0]
    assert [s.to_dict() for s in restored] == [s.to_dict() for s in partial]
    assert restored[0].status is Sample.Status.ABORTED

    # The resumed source continues exactly like the original: buffered group first, then the same prompts/indices.
    a, b = ds.get_samples(5), resumed.get_samples(5)
    assert [[s.to_dict() for s in g] for g in a] == [[s.to_dict() for s in g] for g in b]


def test_load_is_a_noop_for_a_fresh_start(tiny_kit, prompt_file, tmp_path):
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, load=str(tmp_path)))
    ds.load(-1)  # a fresh run (or one started from a release checkpoint) resumes "after rollout -1"
    ds2 = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, load=None))
    ds2.load(3)
    assert (ds.sample_index, ds.epoch_id, ds2.sample_index) == (0, 0, 0)
    assert labels(ds.get_samples(1)) == ["0"]


def test_resume_without_data_position_is_an_error(tiny_kit, prompt_file, tmp_path):
    """The trainers resumed after rollout 3, so silently restarting the dataset would replay prompts: refuse."""
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, load=str(tmp_path)))
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint 3 has no rollout data-source state .*global_dataset_state_dict_3\.pt"
    ):
        ds.load(3)


def test_unreadable_state_names_the_file(tiny_kit, prompt_file, tmp_path):
    path = tmp_path / "rollout" / "global_dataset_state_dict_1.pt"
    path.parent.mkdir()
    path.write_text("garbage")
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, load=str(tmp_path)))
    with pytest.raises(RuntimeError, match="cannot read rollout data-source state .*global_dataset_state_dict_1.pt"):
        ds.load(1)


def test_empty_prompt_data_is_a_clear_error(tiny_kit, tmp_path):
    empty = tmp_path / "empty.jsonl"
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "What is 1+1? " * 50}], "label": "2"}) + "\n"
    )
    with pytest.raises(ValueError, match="has no usable prompts"):
        RolloutDataSource(make_args(tiny_kit, str(long_prompt), rollout_max_prompt_len=8))
    empty.write_text("")
    with pytest.raises(Exception, match="empty.jsonl"):
        RolloutDataSource(make_args(tiny_kit, str(empty)))


def record_disk_writes(monkeypatch):
    """Log of ("fsync", path) and ("replace", src, dst) in call order, the real calls still made."""
    log, fsync, replace = [], os.fsync, os.replace

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_replace(src, dst):
        log.append(("replace", os.path.abspath(src), os.path.abspath(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    return log


def test_saved_state_is_on_disk_before_it_is_published(tiny_kit, prompt_file, tmp_path, monkeypatch):
    """A power loss right after save() returns keeps the state: its bytes are fsynced before the rename, and the
    rename (the directory entry) before save() returns; the driver writes the tracker only after that."""
    save_dir = str(tmp_path / "ckpt")
    ds = RolloutDataSourceWithBuffer(make_args(tiny_kit, prompt_file, save=save_dir))
    ds.get_samples(2)
    log = record_disk_writes(monkeypatch)
    ds.save(1)
    path = os.path.join(save_dir, "rollout", "global_dataset_state_dict_1.pt")
    [(_, tmp, dst)] = [e for e in log if e[0] == "replace"]
    assert dst == path
    assert log == [("fsync", tmp), ("replace", tmp, path), ("fsync", os.path.dirname(path))]


def test_tracker_is_durable_when_written(tmp_path, monkeypatch):
    from slime.utils.checkpoint_tracker import read_tracker, write_tracker

    log = record_disk_writes(monkeypatch)
    write_tracker(str(tmp_path), 7)
    tracker = str(tmp_path / "latest_checkpointed_iteration.txt")
    [(_, tmp, _)] = [e for e in log if e[0] == "replace"]
    assert log == [("fsync", tmp), ("replace", tmp, tracker), ("fsync", str(tmp_path))]
    assert read_tracker(str(tmp_path)) == 7
