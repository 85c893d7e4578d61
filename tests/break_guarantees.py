"""Break each guaranteed property on purpose and check that the test guarding it fails.

    .venv/bin/python tests/break_guarantees.py          # all of them (docs/performance.md says how long)
    .venv/bin/python tests/break_guarantees.py 6a 7     # some

A test that cannot fail proves nothing: this shows each one in docs/guarantees.md can. The breaks in the launch
script show that the scripts' own wiring is guarded too, not only the shared functions it calls. Every break is
made in a throw-away copy of the repository's files (those git tracks, and new ones it does not ignore), never in
your working tree.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQ, TR, DI = "tests/test_equivalence.py::", "tests/test_training.py::", "tests/test_distributed.py::"
WI, WO = "tests/test_wiring.py::", "tests/test_words.py::"
HS, GP = "tests/test_host_syncs.py::", "tests/test_gpu_path.py::"
OG, OD = "tests/test_one_gate.py::", "tests/test_on_device.py::"
PR, ST = "tests/test_preemption.py::", "tests/test_store.py::"
RESUME_MATRIX = (
    "tests/test_resume_matrix.py::test_every_interrupted_run_resumes_to_the_uninterrupted_runs_weights_and_metrics"
)
FR, MB, FT = "tests/test_files_read_back.py::", "tests/test_micro_batch.py::", "tests/test_fine_tuning.py::"
TK = "tests/test_tracking.py::"
NAMES_RUN = "tests/test_file_names.py::test_a_run_on_any_names_trains_and_scores_each_image_once_under_its_own_bytes"
NO_WAIT_STEP = HS + "test_a_training_step_on_fake_cuda_makes_the_host_wait_for_nothing"
STEP_TEST = EQ + "test_ddp_with_sync_bn_takes_the_same_steps_as_one_process_on_the_whole_batch"
SHARD_TEST = EQ + "test_training_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch"

# (name, file, text, replacement, the test that must fail)
LAUNCH, SPAWN_SCRIPT = "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py"
SAME_AS_SPAWN = TR + "test_torchrun_and_spawn_train_identically"
BREAKS = [
    ("1 SyncBN backward not reduced", "multi_train_utils/sync_batchnorm.py", "        dist.all_reduce(sums)\n", "",
     STEP_TEST),
    ("1a SyncBN statistics not reduced", "multi_train_utils/sync_batchnorm.py", "    dist.all_reduce(moments)\n", "",
     STEP_TEST),
    ("1b lr not scaled by world size", "recipe/optimizer.py", "return config.lr * world_size * config.accumulate",
     "return config.lr * config.accumulate", STEP_TEST),
    ("1c launch script: lr of one process", LAUNCH, "len(train_loader), world_size=process.world_size)",
     "len(train_loader))", SAME_AS_SPAWN),
    ("2 SyncBN despite --no-sync-bn", LAUNCH, "if config.sync_bn and not config.freeze_layers:",
     "if not config.freeze_layers:", TR + "test_without_sync_bn_each_process_keeps_its_own_batchnorm_statistics"),
    ("3 augmentation seeded by the clock", "my_dataset.py", "torch.default_generator.manual_seed(seed)\n",
     "torch.default_generator.seed()\n",
     TR + "test_the_same_seed_gives_bitwise_identical_weights_and_another_seed_does_not"),
    ("4 spawn ranks seeded differently", SPAWN_SCRIPT, "        train(config, plan, process)\n",
     "        train(type(config)(**{**vars(config), 'seed': config.seed + rank}), plan, process)\n", SAME_AS_SPAWN),
    ("5 augmentation from worker RNG", "dataset/sampling.py",
     "yield list(zip(batch, sample_seeds(self.seed, self.epoch, batch).tolist(), strict=True))", "yield list(batch)",
     EQ + "test_augmented_tensors_do_not_depend_on_the_number_of_loader_workers"),
    ("6a shards padded with repeats", "multi_train_utils/distributed_utils.py", "seed=seed, drop_last=True",
     "seed=seed", SHARD_TEST),
    ("6b no reshuffle per epoch", "dataset/sampling.py", "        self.batch_sampler.sampler.set_epoch(epoch)\n", "",
     SHARD_TEST),
    ("6c launch script: no shards", LAUNCH, "config.seed, process.rank, process.world_size)", "config.seed)",
     SAME_AS_SPAWN),
    ("7 padded validation sampler", "multi_train_utils/distributed_utils.py",
     "return range(rank, len(dataset), world_size)",
     "return DistributedSampler(dataset, world_size, rank, shuffle=False)",
     DI + "test_validation_counts_every_image_once_whatever_the_world_size"),
    ("7b the loaders: every rank validates all", "my_dataset.py", "sampler=val_sampler, ", "",
     DI + "test_validation_counts_every_image_once_whatever_the_world_size"),
    ("7c the loaders: every rank validates all it holds on the device", "my_dataset.py",
     "ValidationBatches(val_set, val_sampler,", "ValidationBatches(val_set, range(len(val_set)),",
     TR + "test_logged_validation_accuracy_is_the_single_process_accuracy_of_the_saved_weights"),
    ("8a logged loss of rank 0 only", "multi_train_utils/bookkeeping.py",
     "self.work = all_reduce_in_background(values)", "self.work = None", STEP_TEST),
    ("8b reduce_value does not average", "multi_train_utils/distributed_utils.py",
     "            value /= get_world_size()\n", "            pass\n",
     EQ + "test_reduce_value_averages_or_sums_over_ranks_and_leaves_its_input_alone"),
    ("8c val_acc of rank 0 only", "multi_train_utils/bookkeeping.py",
     "counts = reduce_value(counts, average=False).cpu()",
     "counts, max_skipped = counts.cpu(), None",  # (else the unreadable-image limit stops the run first)
     TR + "test_logged_validation_accuracy_is_the_single_process_accuracy_of_the_saved_weights"),
    # The tests build what the scripts build, by running the scripts' own statements (tests/wiring.py); the
    # scripts differ only where they say so, and words stay true (tests/test_wiring.py, tests/test_words.py)
    ("9a launch script's validation shards, as the tests build them", LAUNCH,
     "val_sampler = val_shard(val_set, process.rank, process.world_size)", "val_sampler = val_shard(val_set, 0, 1)",
     DI + "test_validation_counts_every_image_once_whatever_the_world_size"),
    ("9b single script's model, as the tests build it", "train_single_gpu.py",
     "choice.memory_format, seed=config.seed,", "choice.memory_format, seed=config.seed + 1,", STEP_TEST),
    ("9c the DDP scripts train apart", SPAWN_SCRIPT, "trained = torch.compile(trained) if config.compile else trained",
     "trained = torch.compile(trained, dynamic=False) if config.compile else trained",
     WI + "test_the_two_ddp_scripts_train_alike"),
    ("9d a DDP change that does not say so", LAUNCH, "# DDP: rank 0 alone writes the run's files",
     "# Rank 0 alone writes the run's files",
     WI + "test_every_line_the_launch_script_changes_says_which_ddp_concept_it_is"),
    ("9e the README names a function gone", "README.md", "`shuffled_batches(", "`shuffle_batches(",
     WO + "test_every_file_test_function_and_flag_a_page_names_exists"),
    # The GPU path: nothing in a step makes the host wait for the device (tests/test_host_syncs.py, on fake CUDA
    # tensors), and what a CPU can check of it (tests/test_gpu_path.py)
    ("10a the loss read each step (.item())", "multi_train_utils/bookkeeping.py",
     'mean_loss=f"{self.totals[0] / max(self.totals[1], 1):.3f}"', 'mean_loss=f"{loss_sum.item() / max(read, 1):.3f}"',
     NO_WAIT_STEP),
    ("10b a list made a tensor on the device each step", "dataset/transforms.py",
     "scale, shift = normalising_constants(images.device)",
     "scale, shift = normalising_constants.__wrapped__(images.device)", NO_WAIT_STEP),
    ("10c a CPU tensor in a CUDA step", "recipe/loss.py", "weights = None if weights is None else weights.to(device)",
     "weights = weights", NO_WAIT_STEP),
    ("10d validation counted by bincount", "multi_train_utils/bookkeeping.py",
     "self.confusion.view(-1).index_add_(0, cells, read)",
     "self.confusion += torch.bincount(cells, read, self.num_classes**2).long().view_as(self.confusion)",
     HS + "test_a_validation_batch_on_fake_cuda_makes_the_host_wait_for_nothing"),
    ("10e SyncBatchNorm reads its count", "multi_train_utils/sync_batchnorm.py", "    total = moments[-1]\n",
     "    total = moments[-1].item()\n", NO_WAIT_STEP),
    ("10f torch's EMA update", "recipe/optimizer.py", "return ExponentialMovingAverage(model, decay)",
     "return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)", NO_WAIT_STEP),
    ("10g SGD not fused (float16's scaler reads)", "recipe/optimizer.py",
     "momentum=config.momentum, weight_decay=config.weight_decay, fused=True",
     "momentum=config.momentum, weight_decay=config.weight_decay, fused=False", NO_WAIT_STEP),
    ("10h fused SGD's momentum left unset", "recipe/optimizer.py",
     "        for param in params if config.momentum else []:\n", "        for param in []:\n",
     GP + "test_float16_steps_skipped_by_the_scaler_leave_the_fused_sgd_as_torchs_default_sgd_leaves_it"),
    ("10i SyncBatchNorm's backward without the saved statistics (a GPU asserts them)",
     "multi_train_utils/sync_batchnorm.py", "weight, None, None, mean, invstd, True, ctx.eps",
     "weight, mean, var, None, None, False, ctx.eps", NO_WAIT_STEP),
    ("11a every GPU's generator restored", "multi_train_utils/checkpoint.py",
     "    return state[\"epoch\"] + 1, state[\"best_acc\"]\n",
     "    if torch.cuda.is_available() and \"rng\" in state:\n"
     "        torch.cuda.set_rng_state_all(state[\"rng\"][\"cuda\"])\n"
     "    return state[\"epoch\"] + 1, state[\"best_acc\"]\n",
     GP + "test_a_checkpoint_saved_with_any_number_of_gpus_resumes_with_any_other"),
    ("11b a step's draws not seeded", "multi_train_utils/bookkeeping.py", "            self.seed_random_draws(step)\n",
     "", GP + "test_a_network_with_dropout_stopped_within_an_epoch_resumes_to_the_uninterrupted_runs_weights"),
    ("11c every rank draws alike", "multi_train_utils/bookkeeping.py",
     "self.epoch, step, get_rank())", "self.epoch, step, 0)",
     GP + "test_each_rank_draws_dropout_masks_of_its_own_and_the_same_at_the_same_step_whatever_came_before"),
    ("11d --device cuda:1 not made current", "multi_train_utils/distributed_utils.py",
     "    process = Process(device=resolve_device(device))\n    use_device(process.device)\n",
     "    process = Process(device=resolve_device(device))\n",
     GP + "test_one_process_on_cuda_1_makes_it_the_current_gpu_and_waits_for_its_sums_on_its_stream"),
    ("11e float16 resumes from an empty scaler", "multi_train_utils/checkpoint.py",
     'if state.get("scaler") and training.scaler is not None:', 'if state.get("scaler") is not None:',
     GP + "test_a_checkpoint_trained_without_float16_resumes_with_float16s_gradient_scaler"),
    ("11f a resumed epoch timed from the resume", "multi_train_utils/stop_and_resume.py",
     '"lr": self.lr, "seconds": self.seconds}', '"lr": self.lr}',
     GP + "test_a_resumed_epochs_time_and_speed_count_its_training_before_the_stop_and_not_the_time_stopped"),
    # Files read back are checked where they are read (tests/test_files_read_back.py)
    ("12a autotune's cache trusted whatever its shape", "autotune/remembered.py",
     'damage = misfits(cache, {"entries": [ENTRY_SHAPE]})', "damage = []",
     FR + "test_a_damaged_autotune_cache_is_measured_again_with_one_warning_and_replaced"),
    ("12b a checkpoint's entries trusted", "multi_train_utils/checkpoint.py",
     "damage = misfits(state, CHECKPOINT_SHAPE)", "damage = []",
     FR + "test_a_checkpoint_whose_entries_have_other_shapes_is_refused_naming_it"),
    ("13a a resumed epoch draws one step early", "multi_train_utils/bookkeeping.py",
     "self.epoch, step, get_rank())", "self.epoch, step - (self.midway is not None), get_rank())", RESUME_MATRIX),
    ("13b nan passes the number check", "utils.py", "        if not math.isfinite(value):", "        if False:",
     OG + "test_nan_and_infinity_are_refused_from_the_command_line_and_from_a_config_file"),
    ("13c --config skips the checks", "run/config.py",
     'return admitted({name: record[name] for name in wanted if name in record}, f"--config {path}")',
     "return {name: record[name] for name in wanted if name in record}",
     OG + "test_a_config_file_admits_a_value_exactly_when_the_command_line_admits_it_typed"),
    ("13d a checkpoint's record unchecked", "run/plan.py",
     '    checked = Config.from_record(state["args"], source).record()', '    checked = state["args"]',
     OG + "test_a_checkpoints_record_is_admitted_by_the_same_checks_or_refused_naming_the_checkpoint"),
    ("13e launcher variables unchecked", "multi_train_utils/distributed_utils.py",
     "        return number(int, minimum, maximum)(text)", "        return int(text)",
     OG + "test_a_launchers_counts_are_admitted_exactly_when_they_describe_a_job"),
    ("13f a resume writes into another run", "run/plan.py",
     "    if (finished or found and resume is not None) and not unsaved:\n", "    if False:\n",
     "tests/test_run_folder.py::"
     "test_a_resume_into_another_runs_folder_is_refused_and_one_into_a_new_folder_leaves_its_own_run_alone"),
    ("13g a checkpoint's CRC-32s unchecked", "read_back.py",
     "damage = damaged_record(path) if start.startswith(ZIP_MAGIC) else None", "damage = None",
     FR + "test_a_checkpoint_with_a_byte_flipped_is_refused_or_loads_the_saved_tensors"),
    ("13h a resume's micro-batch change unsaid", "run/plan.py",
     '(saved.get("micro_batch") or saved_batch, saved_world)', "(saved_batch, saved_world)",
     "tests/test_resume_matrix.py::test_a_resume_says_when_another_forward_pass_makes_it_inexact"),
    ("13i the run says nothing of a resume", "run/plan.py",
     ", inexact_resume_note(config, plan.saved, process.world_size, choice)]", "]",
     "tests/test_resume_matrix.py::test_a_resume_with_another_micro_batch_says_so_as_it_decides_how_to_compute"),
    ("13j loader workers waited for at exit", "my_dataset.py",
     "@atexit.register  # after", "# after",
     "tests/test_preemption.py::test_a_process_whose_loader_workers_were_never_shut_down_exits_at_once"),
    ("14a a micro-batch's loss its own mean", "multi_train_utils/train_eval_utils.py",
     "loss = piece_sum / read if read", "loss = piece_sum / len(labels) if read",
     MB + "test_micro_batches_take_the_step_of_the_whole_batch"),
    ("14b auto takes a micro-batch too large", "multi_train_utils/memory.py", "    return low\n",
     "    return high\n", MB + "test_auto_settles_on_the_largest_micro_batch_that_fits_and_remembers_it"),
    ("14c BatchNorm updated again when recomputed", "network/checkpointing.py",
     "    model.register_forward_hook(running_statistics_off)\n", "",
     MB + "test_gradient_checkpointing_takes_the_same_steps_under_ddp_with_accumulation"),
    ("14d clipped before unscaling", "multi_train_utils/train_eval_utils.py",
     "        scaler.unscale_(training.optimizer)", "        pass",
     FT + "test_under_a_gradient_scaler_the_clipped_norm_is_max_in_the_gradients_true_units"),
    ("14e weight decay on norms", "network/groups.py", "        if isinstance(layer, NORMS):", "        if False:",
     FT + "test_norm_weights_and_biases_take_norm_weight_decay_and_the_other_weights_weight_decay"),
    ("14g timm's BatchNorm left unsynchronised", "multi_train_utils/sync_batchnorm.py",
     '    return isinstance(layer, nn.BatchNorm2d) and type(layer).__name__ == "BatchNormAct2d"',
     "    return False and isinstance(layer, nn.BatchNorm2d)",
     FT + "test_sync_bn_synchronises_timms_batchnorm_with_its_activation"),
    ("15a an epoch tracked before it is saved", "run/run_log.py",
     "        self.writer.write(write, after=lambda: self.tracking.epoch(line))",
     "        self.tracking.epoch(line)\n        self.writer.write(write)",
     TK + "test_each_epoch_is_logged_once_with_the_figures_of_the_run_that_finished_it"),
    ("15b every rank tracks", "run/run_log.py",
     "        if enabled:\n            self.tracking.start(logged, start_epoch)",
     "        if enabled:\n            self.tracking.start(logged, start_epoch)\n        else:\n"
     "            self.tracking = Tracking(config, plan, self.record, process.device)\n"
     "            self.tracking.start([], start_epoch)",
     TK + "test_a_torchrun_run_stopped_failed_and_resumed_on_one_process_is_one_tracked_run_marked_as_it_ended"),
    ("14f layer decay one layer off", "network/groups.py", "layer_decay ** (len(prefixes) - depth)",
     "layer_decay ** (len(prefixes) - depth - 1)",
     FT + "test_layer_decay_gives_the_head_the_full_rate_and_each_stage_before_it_f_times_the_next"),
    # Saving in the background (multi_train_utils/epoch_writer.py, issue 44)
    ("17a a stop not waiting for the write in flight", "multi_train_utils/stop_and_resume.py",
     "    log.wait_for_writes()\n", "", PR + "test_a_stop_during_an_epochs_write_waits_for_it_and_resumes_bitwise"),
    ("17b the run's end not waiting for the last write", "run/run_log.py",
     "            self.wait_for_writes()  # the epochs ended well", "            pass  # the epochs ended well",
     "tests/test_filesystem.py::test_a_full_disk_while_saving_stops_the_run_in_one_line_and_resume_continues"),
    ("17d a torch operation in the background writer", "run/tensorboard.py",
     "preview_figure(self.pixels, self.preview[1]",
     "preview_figure((self.preview[0].permute(0, 2, 3, 1) / 255).numpy(), self.preview[1]",
     TR + "test_the_background_writer_starts_no_compute_threads_of_its_own"),
    # Every case of a class (issue 45)
    ("18a a container's CPU quota ignored", "machine.py",
     "    return max(1, min(cores, math.ceil(quota[0]))) if quota else cores\n", "    return cores\n",
     "tests/test_cores.py::test_a_cgroup_v2_cpu_quota_on_the_cgroup_or_one_above_it_caps_the_cores"),
    ("18b a run's record in its checkpoint left unread", "run/records.py",
     "    saved = run_file(weights, CHECKPOINT_NAME)\n", "    saved = None\n",
     "tests/test_predict.py::test_weights_whose_run_lost_its_args_json_take_the_flags_its_checkpoint_records_and_say_so"),
    ("18c a model's input size left unchecked", "run/plan.py",
     "    check_input_size(config.model, config.img_size)  # a ViT at 48 px: one line, before any folder is made\n", "",
     "tests/test_bad_input.py::test_a_model_that_cannot_take_the_image_size_is_refused_in_one_line_before_any_folder_is_made"),
    ("18d an image damaged since the stop called another split", "run/plan.py", "    if changed and unreadable:\n",
     "    if False:\n",
     "tests/test_run_folder.py::test_a_resume_on_data_that_lost_or_gained_images_is_refused_and_one_on_moved_data_continues"),
    ("18e a checkpoint saved before the tracker answered names no tracked run", "run/tracking.py",
     "            self.opened.wait(STOP_WAIT)\n", "            pass\n",
     TK + "test_a_restart_continues_the_tracked_run_logs_the_epochs_it_lacks_and_marks_each_end"),
    ("18f the tracker's own log lines let through", "run/tracking.py", '"MLFLOW_LOGGING_LEVEL": "CRITICAL"',
     '"MLFLOW_LOGGING_LEVEL": "WARNING"', TK + "test_a_tracker_removed_while_the_run_trains_costs_one_warning"),
    ("18g a database tracker tried as long as MLflow would", "run/tracking.py",
     "        mlflow.store.db.utils.MAX_RETRY_COUNT = DATABASE_TRIES\n", "",
     TK + "test_a_tracker_that_cannot_be_opened_costs_one_warning_and_seconds"),
    ("18h a split seeded by a name's strict UTF-8", "dataset/folders.py",
     'random.Random(f"{seed}:{name}".encode("utf-8", NAMES))', 'random.Random(f"{seed}:{name}")',
     "tests/test_file_names.py::test_any_names_are_listed_split_and_written_back_as_the_same_bytes"),
    ("18i the output's names encoded strictly", "utils.py", "                stream.reconfigure(errors=NAMES)\n",
     "                pass\n", NAMES_RUN),
    ("18j a start that finished no epoch keeps its folder from a new run", "run/plan.py",
     "    if (finished or found and resume is not None) and not unsaved:\n",
     "    if (found and not restart or finished) and not unsaved:\n",
     "tests/test_run_folder.py::test_a_run_that_failed_before_its_first_epoch_ended_leaves_its_folder_to_the_corrected_command"),
    ("18k a new run continues the tracked run of a start that finished no epoch", "run/plan.py",
     "            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()\n",
     "            path.name == 'tracked_run.json' or (shutil.rmtree(path) if path.is_dir() else path.unlink())\n",
     TK + "test_a_run_refused_in_its_first_epoch_leaves_its_folder_to_the_corrected_command_tracked_anew"),
    # What a run needs checked first, a damaged tracked record recovered, files as the docs say (issue 57, 3)
    ("21a compile's compiler found missing only at the first step", "run/plan.py",
     "    config = compiled_if_it_can(config)\n", "",
     "tests/test_needs.py::test_what_a_run_lacks_beyond_python_is_said_before_its_data_is_read"),
    ("21b an id the tracker rejects leaves the run untracked", "run/tracking.py",
     '("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")', '("RESOURCE_DOES_NOT_EXIST",)',
     TK + "test_a_record_of_the_tracked_run_damaged_in_any_way_is_recovered_with_every_finished_epoch"),
    ("21c a results file holding a name's raw bytes", "inference/results.py",
     '.encode("utf-8", "backslashreplace").decode("utf-8")', "",
     "tests/test_file_names.py::test_a_results_file_is_utf8_whose_documented_reading_gives_back_every_name"),
    # Writes that fail, advice that works (issue 57, 3)
    ("20a TensorBoard's epoch written outside utils.writing", "run/tensorboard.py",
     "        with writing(self.folder):\n            for tag, key in",
     "        if True:\n            for tag, key in",
     "tests/test_write_failures.py::test_a_write_that_fails_is_one_line_naming_the_place_and_the_cause"),
    ("20b --auto-resume refuses a folder whose first epoch saved no checkpoint", "run/plan.py",
     "    unsaved = restart and len(read_metrics(output_dir / METRICS_NAME)) <= 1", "    unsaved = False",
     "tests/test_advice.py::test_the_command_a_stopped_run_advises_trains_it_to_its_end"
     "[a_full_disk_as_the_first_epoch_saves]"),
    # Each epoch's weights written once (issue 58)
    ("22a the weights written twice an epoch", "multi_train_utils/checkpoint.py",
     '            link_or_copy(folder / "last.pth", named[part])',
     "            save_atomically(tensors, named[part])",
     "tests/test_saving.py::test_an_epoch_serialises_each_tensor_of_its_state_once"),
    ("20c the room for held images counted without the chunk being copied", "autotune/choose.py",
     "    needed = held + STAGING  #", "    needed = held  #",
     OD + "test_images_held_take_what_they_need_whatever_their_shapes_and_the_budget_counts_the_peak"),
    # The code's shape (tests/test_layers.py, tests/test_readable.py, tests/test_words.py; issue 56)
    ("19a an import that runs back up", "dataset/images.py", "import math\n",
     "import math\n\nimport run.config  # noqa: F401\n", "tests/test_layers.py::test_every_import_points_down_a_layer"),
    ("19b a function of 9 parameters", "my_dataset.py",
     "def loaders(train_set, val_set, batches, val_sampler, config, choice, device: torch.device):",
     "def loaders(train_set, val_set, batches, val_sampler, config, choice, device: torch.device, spare=None):",
     "tests/test_readable.py::test_no_function_or_module_is_oversized"),
    ("19c a page naming a file that moved", "docs/code-map.md", "`python tools/code_size.py` counts",
     "`python tools/code_size.py` (once run/code_size.py) counts",
     "tests/test_words.py::test_no_page_names_a_file_or_links_a_page_that_does_not_exist"),
    # Batches made on the device (dataset/on_device.py, issue 43)
    ("16a a crop box drawn from another seed", "dataset/on_device.py",
     "np.array([seed for _, seed in pairs], dtype=np.uint64)",
     "np.array([seed + 1 for _, seed in pairs], dtype=np.uint64)",
     OD + "test_each_epochs_boxes_and_flips_on_the_device_are_the_loaders_integers"),
    ("16b a host read in the batch's making", "dataset/on_device.py",
     "    height, width, flipped, readable = table.unbind(1)\n",
     "    height, width, flipped, readable = table.unbind(1)\n    int(height.max())\n",
     NO_WAIT_STEP + "[off-channels-last-on-device]"),
    ("16c the images held anew every epoch", "dataset/on_device.py",
     "        batches = list(self.batch_sampler)  # this epoch's",
     "        self.pixels, self.offsets = held_on(self.device, self.dataset.decoded)\n"
     "        batches = list(self.batch_sampler)  # this epoch's",
     NO_WAIT_STEP + "[off-channels-last-on-device]"),
    ("16d the CPU's crops resampled otherwise than the loader's", "dataset/on_device.py",
     "[self.size] * 2, antialias=True)", "[self.size] * 2, antialias=False)",
     OD + "test_the_cpus_training_batches_held_or_streamed_are_the_loaders_bitwise"),
    # The image store and the batches streamed from it (dataset/store.py, dataset/on_device.py; issue 59)
    ("17c two runs building one store at once", "dataset/store.py",
     '    with locked(folder / f"{name}.lock"):\n', "    if True:\n",
     ST + "test_two_runs_building_one_store_at_once_make_one_build_and_the_second_maps_it"),
    ("59a a stale store read", "dataset/store.py", "\\0{stat.st_size}\\0{stat.st_mtime_ns}\\n", "\\0{stat.st_size}\\n",
     ST + "test_a_store_is_found_by_its_files_and_decode_sizes_and_never_read_stale_or_damaged"),
    ("59b a batch gathered with another epoch's boxes", "dataset/on_device.py",
     "            yield from self.stream(parts)\n",
     "            self.first = getattr(self, 'first', parts)\n            yield from self.stream(self.first)\n",
     OD + "test_the_cpus_training_batches_held_or_streamed_are_the_loaders_bitwise"),
    ("59c a host wait in the copy", "dataset/on_device.py",
     "boxes = boxes.to(self.device, non_blocking=True)", "boxes = boxes.to(self.device, non_blocking=False)",
     NO_WAIT_STEP + "[off-channels-last-streamed]"),
    ("59d the host's boxes gathered by torch in the stream's thread", "dataset/on_device.py",
     '    if pixels.device.type == "cpu":  # numpy', '    if False:  # numpy',
     OD + "test_gathering_boxes_from_the_host_in_a_thread_of_its_own_starts_no_compute_threads"),
]  # fmt: skip


def main(selected: list[str]) -> int:
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]  # new files too, not ignored ones
    tracked = [
        file
        for file in subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        if (ROOT / file).is_file()  # (a file deleted in the working tree is still in git's index)
    ]
    missed = 0
    for name, path, text, replacement, test in BREAKS:
        if selected and name.split()[0] not in selected:
            continue
        with tempfile.TemporaryDirectory() as copy:
            for file in tracked:
                (Path(copy) / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / file, Path(copy) / file)
            source = Path(copy) / path
            original = source.read_text()
            if original.count(text) != 1:
                raise SystemExit(f"{name}: the text to break is not in {path} exactly once; update this script")
            source.write_text(original.replace(text, replacement))
            command = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                test,
            ]  # no workers
            result = subprocess.run(command, cwd=copy, capture_output=True, text=True)
        summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-200:]
        # Caught means an assertion failed; an error (the broken copy did not even run) proves nothing.
        caught = " failed" in summary and "error" not in summary
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {name:36s} {test.split('::')[1]}  [{summary}]", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
