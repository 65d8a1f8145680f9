// A character-level GPT trained on the text of Debian's `fortunes` package with more training
// state than the device is allowed to hold: weights and optimizer state live in host memory, each
// layer's weights are fetched as the step reaches them (overlapped with the compute before), and
// the optimizer runs on the host's cores. The library plans the step before it allocates anything,
// so the plan is printed first; the trainer then holds to it.
//
//   stream_gpt [--steps N] [--budget-mib N] [--width N] [--depth N] [--batch N]
//              [--checkpoint FILE] [--device INDEX_OR_NAME] [--text DIR]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

#include "example_options.hpp"
#include "ferry/ferry.hpp"

namespace {

struct Args {
  std::uint32_t steps = 60;
  std::uint32_t budget_mib = 32;  // device bytes the step may use: a fifth of the training state
  std::uint32_t width = 384, depth = 6, batch = 8;
  std::string checkpoint;  // empty: none written
  std::string device;      // empty: $FERRY_DEVICE, else the first GPU, else the first device
  std::string text_dir;    // empty: $FERRY_TEXT_DIR, else Debian's fortunes folder
};

void usage() {
  std::fputs(
      "usage: stream_gpt [--steps N] [--budget-mib N] [--width N] [--depth N] [--batch N]\n"
      "                  [--checkpoint FILE] [--device INDEX_OR_NAME] [--text DIR]\n",
      stderr);
}

Args parse_args(int argc, char** argv) {
  using example::parse_count;
  Args a;
  example::for_each_option(argc, argv, usage, [&](std::string_view name, std::string_view value) {
    if (name == "--steps") {
      a.steps = parse_count(name, value);
    } else if (name == "--budget-mib") {
      a.budget_mib = parse_count(name, value);
    } else if (name == "--width") {
      a.width = parse_count(name, value);
    } else if (name == "--depth") {
      a.depth = parse_count(name, value);
    } else if (name == "--batch") {
      a.batch = parse_count(name, value);
    } else if (name == "--checkpoint") {
      a.checkpoint = value;
    } else if (name == "--device") {
      a.device = value;
    } else if (name == "--text") {
      a.text_dir = value;
    } else {
      return false;
    }
    return true;
  });
  return a;
}

double mib(std::uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

int run(const Args& a) {
  const ferry::TextCorpus corpus = ferry::load_text_corpus(ferry::fortune_files(a.text_dir));
  ferry::models::GptConfig gpt;
  gpt.vocab = corpus.vocab_size();
  gpt.width = a.width;
  gpt.depth = a.depth;
  gpt.heads = 4;
  gpt.context = 64;
  const ferry::ModelSpec model = ferry::models::gpt(gpt);

  ferry::Runtime runtime({.device = a.device});
  ferry::TrainerOptions options;
  options.batch = a.batch;
  options.lr = 2e-3f;
  options.optimizer.kind = ferry::ops::OptimizerConfig::Kind::adamw;
  options.residency.mode = ferry::graph::ResidencyMode::stream;  // weights and state in host memory
  options.residency.budget_bytes = std::uint64_t{a.budget_mib} << 20;
  options.residency.host_optimizer = true;  // updates on the host cores, in place, once the step is known good
  options.recompute_auto = true;            // recompute activations if that is what it takes to fit

  // The plan, before anything is allocated: a budget too small for even one layer at a time is an
  // error here (graph::BudgetError, naming the smallest budget that works).
  const ferry::TrainingPlan plan = ferry::plan_training(runtime, model, options);
  const ferry::PhasePlan& step = plan.phases.front();
  std::printf(
      "plan: device peak %.1f of %.1f MiB (streamed: at least %.1f MiB), host %.1f MiB, %.1f MiB over the "
      "link a step\n",
      mib(plan.device_peak_bytes), mib(plan.device_budget_bytes), mib(plan.min_budget_bytes), mib(plan.host_bytes),
      mib(step.fetch_bytes + step.write_back_bytes));

  ferry::Trainer trainer(runtime, model, options);
  std::printf("%s on %s: %llu parameters, training state %.1f MiB, device peak %.1f MiB\n", model.name.c_str(),
              runtime.device().name.c_str(), static_cast<unsigned long long>(trainer.parameter_count()),
              mib(trainer.training_state_bytes()), mib(trainer.device_peak_bytes()));

  // Random windows of the training text; the held-out tail for validation.
  ferry::RandomWindows windows(corpus, gpt.context, a.batch, /*seed=*/1);
  const ferry::TextWindows held_out = ferry::TextWindows::held_out(corpus, gpt.context, 64);
  ferry::TrainingLoopOptions loop_options;
  loop_options.steps = a.steps;
  loop_options.boundary_every = 20;  // a report, and a checkpoint when one is asked for
  loop_options.units_per_step = std::uint64_t{a.batch} * gpt.context;
  loop_options.unit = "tokens";
  loop_options.checkpoint = a.checkpoint;
  ferry::TrainingLoop loop(trainer, windows, loop_options);
  loop.on_boundary = [&](const ferry::LoopPosition& p) {
    std::printf("step %llu/%u: train loss %.4f, held-out loss %.4f nats/char\n",
                static_cast<unsigned long long>(p.done), a.steps, p.recent_loss(), trainer.evaluate(held_out).loss);
  };
  const ferry::LoopSummary summary = loop.run();
  if (summary.end == ferry::LoopSummary::End::stopped) return 128 + summary.signal;  // SIGINT / SIGTERM

  const ferry::graph::ResidencyReport& r = trainer.residency();
  std::printf("done: %.1f ms a step, %llu fetches of %.1f MiB and %llu host updates a step\n", summary.mean_step_ms,
              static_cast<unsigned long long>(r.fetches), mib(r.fetch_bytes),
              static_cast<unsigned long long>(r.host_updates));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return example::main_of("stream_gpt", argc, argv, usage, parse_args, run);
}
