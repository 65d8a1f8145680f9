// A small Fashion-MNIST trainer written against the installed ferry library, the way a user
// would: load the data, describe a model, train it with a TrainingLoop, report Trainer::evaluate.
//
//   train_mlp [--model small|mlp] [--epochs N] [--batch N] [--lr X] [--train-limit N]
//             [--device INDEX_OR_NAME] [--data DIR]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "example_options.hpp"
#include "ferry/ferry.hpp"

namespace {

struct Args {
  std::string model = "small";
  std::uint32_t epochs = 2;
  std::uint32_t batch = 128;
  float lr = 1e-3f;
  std::size_t train_limit = 0;  // 0: all 60000 training samples
  std::string device;           // empty: $FERRY_DEVICE, else the first GPU, else the first device
  std::string data_dir;         // empty: $FERRY_DATA_DIR, else Debian's dataset-fashion-mnist folder
};

void usage() {
  std::fputs(
      "usage: train_mlp [--model small|mlp] [--epochs N] [--batch N] [--lr X] [--train-limit N]\n"
      "                 [--device INDEX_OR_NAME] [--data DIR]\n",
      stderr);
}

Args parse_args(int argc, char** argv) {
  using example::parse_number;
  Args a;
  example::for_each_option(argc, argv, usage, [&](std::string_view name, std::string_view value) {
    if (name == "--model") {
      a.model = value;
    } else if (name == "--epochs") {
      a.epochs = example::parse_count(name, value);
    } else if (name == "--batch") {
      a.batch = example::parse_count(name, value);
    } else if (name == "--lr") {
      a.lr = parse_number<float>(name, value);
    } else if (name == "--train-limit") {
      a.train_limit = parse_number<std::size_t>(name, value);
    } else if (name == "--device") {
      a.device = value;
    } else if (name == "--data") {
      a.data_dir = value;
    } else {
      return false;
    }
    return true;
  });
  return a;
}

// A model written inline with the graph builder: each layer call appends nodes to the step graph
// and returns the output tensor. The Trainer replays this function for every compiled variant
// (training at the batch size, evaluation at other sizes), so it must build the same layers each
// time. Autodiff and the optimizer updates are added by the Trainer.
ferry::ModelSpec small_residual_mlp() {
  // A classifier: input "input" [1, 28, 28] f32, target "labels" i32 in [0, 10), softmax
  // cross-entropy of the logits the function returns.
  return ferry::models::classifier("small-residual-mlp", ferry::graph::Shape{1, 28, 28}, 10,
                                   [](ferry::graph::Builder& b, ferry::TensorId x) {
                                     x = b.relu(b.linear(b.flatten(x), 256));  // [batch, 784] -> [batch, 256]
                                     ferry::TensorId h = b.gelu(b.linear(b.layernorm(x), 256));  // a residual block
                                     x = b.add(x, b.linear(h, 256));
                                     return b.linear(b.layernorm(x), 10);  // logits [batch, 10]
                                   });
}

// Standardise pixels with the training set's statistics (Fashion-MNIST: mean 0.286, std 0.353).
void standardise(ferry::Dataset& d) {
  for (float& v : d.images) v = (v - 0.2860f) / 0.3530f;
}

int run(const Args& a) {
  const std::filesystem::path dir =
      a.data_dir.empty() ? ferry::default_fashion_mnist_dir() : std::filesystem::path(a.data_dir);
  ferry::Dataset train = ferry::load_fashion_mnist(dir, ferry::Split::train);
  ferry::Dataset test = ferry::load_fashion_mnist(dir, ferry::Split::test);
  if (a.train_limit != 0 && a.train_limit < train.count) {
    train.count = a.train_limit;
    train.images.resize(train.count * train.sample_elems());
    train.labels.resize(train.count);
  }
  if (train.count < a.batch) {
    throw std::invalid_argument("--batch " + std::to_string(a.batch) + " is larger than the " +
                                std::to_string(train.count) + " training samples");
  }
  standardise(train);
  standardise(test);

  ferry::Runtime runtime({.device = a.device});
  ferry::TrainerOptions options;
  options.batch = a.batch;
  options.lr = a.lr;
  options.optimizer.kind = ferry::ops::OptimizerConfig::Kind::adam;

  ferry::ModelSpec model;
  if (a.model == "small") {
    model = small_residual_mlp();
  } else if (a.model == "mlp") {
    model = ferry::models::mlp({512, 256});
  } else {
    throw std::invalid_argument("unknown model '" + a.model + "': use small or mlp");
  }

  // Compiles the training step once: autodiff, memory plan, kernels bound, flow graph built.
  ferry::Trainer trainer(runtime, std::move(model), options);
  std::printf("%s on %s: %llu parameters, device peak %.1f MiB (planned before the first step)\n",
              trainer.model().name.c_str(), runtime.device().name.c_str(),
              static_cast<unsigned long long>(trainer.parameter_count()),
              static_cast<double>(trainer.device_peak_bytes()) / (1024.0 * 1024.0));

  // A new shuffled order every epoch; full batches (the last partial one is dropped). The loop keeps
  // one step in flight, draws a progress line, and reports each epoch's end to on_boundary.
  ferry::ShuffledBatches batches(train, trainer.model(), a.batch, /*seed=*/1);
  const std::uint64_t per_epoch = batches.steps_per_epoch();
  ferry::TrainingLoop loop(trainer, batches, {.steps = a.epochs * per_epoch, .steps_per_epoch = per_epoch});
  loop.on_boundary = [&](const ferry::LoopPosition& p) {
    std::printf("epoch %llu/%u: train loss %.4f\n", static_cast<unsigned long long>(p.done / per_epoch), a.epochs,
                p.last_epoch_loss);
  };
  const ferry::LoopSummary summary = loop.run();
  if (summary.end == ferry::LoopSummary::End::stopped) return 128 + summary.signal;  // SIGINT / SIGTERM

  const ferry::EvalResult eval = trainer.evaluate(test);  // forward only, shares the trained weights
  std::printf("test accuracy %.4f (loss %.4f, %zu samples)\n", eval.accuracy, eval.loss, eval.samples);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return example::main_of("train_mlp", argc, argv, usage, parse_args, run);
}
