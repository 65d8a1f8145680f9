// What the programs print for scripts (docs/outputs.md): every JSON key `ferry train`, `ferry
// plan` and `ferry-bench` print is documented there (this test reads the page), every line has a
// schema, the --profile CSV parses with a strict reader, and the trace is valid Chrome-trace JSON
// with exactly the steps asked for, args, step markers and host-lane nodes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#if defined(FERRY_CLI) && defined(FERRY_BENCH) && defined(FERRY_OUTPUTS_DOC)

struct Outcome {
  int status = -1;
  std::string out, err;
  std::vector<json> lines;  // stdout lines that are JSON objects
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path scratch_path() {
  return fs::temp_directory_path() / ("ferry-test-outputs-" + std::to_string(::getpid()));
}

// Removes this process's scratch folder (checkpoints, traces, profiles: tens of MB) once every test
// of the binary has run, passed or not.
class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(scratch_path(), ec);
  }
};
[[maybe_unused]] const ::testing::Environment* const remove_scratch =
    ::testing::AddGlobalTestEnvironment(new RemoveScratch);

fs::path scratch() {
  const fs::path d = scratch_path();
  fs::create_directories(d);
  return d;
}

// Where the build put a file, else the same name beside this test (or one folder up): a build
// shipped elsewhere (the GPU kit's bin/) keeps the programs together but not the build's paths.
// The outputs page is also looked for under the working folder (the project root).
std::string located(const std::string& built, const fs::path& relative = {}) {
  if (fs::exists(built)) return built;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec).parent_path();
  const fs::path name = fs::path(built).filename();
  for (const fs::path& dir : {self, self.parent_path()}) {
    if (!ec && fs::exists(dir / name)) return (dir / name).string();
  }
  if (!relative.empty() && fs::exists(relative)) return relative.string();
  return built;  // the error that follows names where it was looked for
}

Outcome run_program(const std::string& built, const std::string& args) {
  const std::string program = located(built);
  const fs::path out = scratch() / "stdout", err = scratch() / "stderr";
  const std::string cmd = "'" + program + "' " + args + " >'" + out.string() + "' 2>'" + err.string() + "'";
  const int rc = std::system(cmd.c_str());
  Outcome r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    auto j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) r.lines.push_back(std::move(j));
  }
  return r;
}

// docs/outputs.md: heading -> the names in its tables' first column (shorthands expanded).
std::map<std::string, std::set<std::string>> documented() {
  std::map<std::string, std::set<std::string>> out;
  const std::string doc = located(FERRY_OUTPUTS_DOC, fs::path("docs") / "outputs.md");
  std::ifstream in(doc);
  EXPECT_TRUE(in) << doc;
  std::string heading;
  const std::regex code("`([^`]+)`");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0 || line.rfind("### ", 0) == 0) {
      heading = line.substr(line.find(' ') + 1);
      continue;
    }
    if (line.rfind("| `", 0) != 0) continue;
    const std::string first = line.substr(1, line.find('|', 1) - 1);
    // `a[].b`, `.c`: a name starting with a dot is a sibling of the full name before it (a[].c).
    std::string full;
    for (std::sregex_iterator m(first.begin(), first.end(), code), end; m != end; ++m) {
      std::string name = (*m)[1];
      if (name.starts_with('.') && full.find('.') != std::string::npos) {
        name = full.substr(0, full.rfind('.')) + name;
      } else {
        full = name;
      }
      out[heading].insert(name);
    }
  }
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::string part;
  for (char c : s) {
    if (c == '.') {
      parts.push_back(part);
      part.clear();
    } else {
      part += c;
    }
  }
  parts.push_back(part);
  return parts;
}

bool matches(const std::string& pattern, const std::string& path, bool prefix) {
  const auto p = split(pattern), k = split(path);
  if (prefix ? p.size() <= k.size() : p.size() != k.size()) return false;
  for (std::size_t i = 0; i < k.size(); ++i) {
    if (p[i] != "*" && p[i] != k[i]) return false;
  }
  return true;
}

// Leaf paths of `j`: "a.b" for key b of object a, "a[].b" for the objects of array a.
void leaves(const json& j, const std::string& prefix, std::vector<std::pair<std::string, bool>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
    const json& v = it.value();
    if (v.is_object() && !v.empty()) {
      leaves(v, path, out);
    } else if (v.is_array() && !v.empty() && v.front().is_object()) {
      for (const auto& e : v) leaves(e, path + "[]", out);
    } else {
      out.push_back({path, v.is_object() || v.is_array()});
    }
  }
}

// Every key of `j` is documented under the heading that contains `section`.
void expect_documented(const json& j, const std::string& section) {
  static const auto doc = documented();
  // The heading named `section`, else one that names it among others ("ferry-bench step and ...").
  const std::set<std::string>* names = nullptr;
  if (const auto it = doc.find(section); it != doc.end()) names = &it->second;
  for (auto it = doc.begin(); !names && it != doc.end(); ++it) {
    const std::string& h = it->first;
    const bool names_it =
        h.find(section + " ") != std::string::npos ||
        (h.size() > section.size() && h.compare(h.size() - section.size(), section.size(), section) == 0);
    if (names_it) names = &it->second;
  }
  ASSERT_NE(names, nullptr) << "docs/outputs.md has no section '" << section << "'";
  std::vector<std::pair<std::string, bool>> paths;
  leaves(j, "", paths);
  for (const auto& [path, container] : paths) {
    bool ok = false;
    for (const auto& pattern : *names) {
      ok = ok || matches(pattern, path, false) || (container && matches(path + ".x", pattern, true));
    }
    EXPECT_TRUE(ok) << section << ": key '" << path << "' is not documented in docs/outputs.md";
  }
}

// A strict RFC 4180 reader: the rows of `text`, failing on a stray quote.
std::vector<std::vector<std::string>> parse_csv(const std::string& text) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string field;
  bool quoted = false, was_quoted = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      if (!field.empty() || was_quoted) throw std::runtime_error("a quote inside an unquoted field");
      quoted = was_quoted = true;
    } else if (c == ',') {
      row.push_back(field);
      field.clear();
      was_quoted = false;
    } else if (c == '\n') {
      row.push_back(field);
      rows.push_back(row);
      row.clear();
      field.clear();
      was_quoted = false;
    } else {
      if (was_quoted) throw std::runtime_error("text after a closing quote");
      field += c;
    }
  }
  if (quoted) throw std::runtime_error("an unterminated quote");
  if (!field.empty() || !row.empty()) throw std::runtime_error("the last line does not end with a newline");
  return rows;
}

void expect_rectangular(const fs::path& p) {
  const auto rows = parse_csv(slurp(p));
  ASSERT_GT(rows.size(), 1u) << p;
  for (std::size_t i = 1; i < rows.size(); ++i) {
    ASSERT_EQ(rows[i].size(), rows[0].size()) << p << " line " << i + 1 << " has another number of fields";
  }
}

TEST(Outputs, TrainJsonProfileAndTrace) {
  const fs::path d = scratch();
  // Streamed with optimizer updates on the host: every lane, host nodes included, has nodes.
  const Outcome r = run_program(FERRY_CLI,
                                "train --model mlp --epochs 1 --train-limit 768 --lr 0.001 --residency stream "
                                "--host-optimizer --json --trace '" +
                                    (d / "t.json").string() + "' --trace-steps 2 --profile '" + (d / "p.csv").string() +
                                    "' --profile-phases '" + (d / "pp.csv").string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u) << r.out;
  const json& j = r.lines[0];
  EXPECT_EQ(j.at("schema"), 1);
  expect_documented(j, "ferry train");
  EXPECT_NE(r.out.find("\"lr\":0.001,"), std::string::npos) << r.out;
  EXPECT_EQ(j.at("steps"), 3);
  EXPECT_EQ(j.at("train_samples"), 768);
  EXPECT_GT(j.at("step_ms").get<double>(), 0);
  EXPECT_GE(j.at("eval_seconds").get<double>(), 0);
  EXPECT_NE(r.err.find("wrote a trace of 2 steps"), std::string::npos) << r.err;

  // The trace: valid JSON, exactly steps 0 and 1, args on every span, a marker per step, host nodes.
  const json t = json::parse(slurp(d / "t.json"));
  expect_documented(t, "--trace FILE (Chrome trace JSON)");
  std::set<std::int64_t> steps;
  std::size_t markers = 0, host = 0, host_thread = 0;
  std::map<int, std::string> lanes;
  for (const auto& e : t.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name")
      lanes[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
  }
  for (const auto& e : t.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    ASSERT_TRUE(e.contains("args")) << e.dump();
    const std::string lane = lanes.at(e.at("tid").get<int>());
    if (lane == "steps") {
      ++markers;
      continue;
    }
    if (lane == "host thread") {  // the submitting thread: an enqueue per node, its waits
      const std::string what = e.at("args").at("host").get<std::string>();
      EXPECT_TRUE(what == "enqueue" || what == "wait") << e.dump();
      host_thread += what == "enqueue";
      steps.insert(e.at("args").at("step").get<std::int64_t>());
      continue;
    }
    steps.insert(e.at("args").at("step").get<std::int64_t>());
    EXPECT_FALSE(e.at("args").at("op").get<std::string>().empty());
    EXPECT_TRUE(e.at("args").at("inputs").is_array());
    EXPECT_TRUE(e.at("args").at("bytes").is_number());
    host += lane == "host";
  }
  EXPECT_EQ(steps, (std::set<std::int64_t>{0, 1}));
  EXPECT_EQ(markers, 2u);
  EXPECT_GT(host, 0u) << "no host-lane node in the trace";
  EXPECT_GT(host_thread, 0u) << "no host-thread enqueue in the trace";

  // The CSVs: rectangular under a strict reader; variants named as documented.
  expect_rectangular(d / "p.csv");
  expect_rectangular(d / "pp.csv");
  const auto rows = parse_csv(slurp(d / "p.csv"));
  ASSERT_EQ(rows[0].size(), 10u);
  const std::regex variant("train|train-nofit|eval[0-9]+|predict|micro");
  for (std::size_t i = 1; i < rows.size(); ++i) {
    EXPECT_TRUE(std::regex_match(rows[i][0], variant)) << "variant '" << rows[i][0] << "'";
    if (rows[i][1] != "plan") {
      EXPECT_LT(std::stoi(rows[i][1]), 2);
    }
  }
}

// Hybrid phases add their own fields (the predictor, Predict runs, the phases' steps).
TEST(Outputs, HybridTrainJson) {
  const Outcome r = run_program(FERRY_CLI,
                                "train --model mlp --epochs 1 --train-limit 1024 --phases hybrid --warmup-steps 1 "
                                "--min-full-steps 1 --confidence 0.01 --json --quiet");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u) << r.out;
  EXPECT_EQ(r.lines[0].at("phases"), "hybrid");
  EXPECT_TRUE(r.lines[0].contains("predictor_residual")) << r.out;
  expect_documented(r.lines[0], "ferry train");
}

TEST(Outputs, OneStepRunAndTraceStepErrors) {
  const fs::path d = scratch();
  const Outcome r = run_program(FERRY_CLI, "train --model mlp --epochs 1 --train-limit 256 --json --quiet --trace '" +
                                               (d / "one.json").string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_EQ(r.lines[0].at("steps"), 1);
  EXPECT_GT(r.lines[0].at("step_ms").get<double>(), 0);
  const json t = json::parse(slurp(d / "one.json"));
  EXPECT_GT(t.at("traceEvents").size(), 6u);
  for (const char* bad : {"0", "-2", "x"}) {
    const Outcome e =
        run_program(FERRY_CLI, std::string("train --model mlp --epochs 1 --train-limit 256 --trace-steps ") + bad);
    EXPECT_NE(e.status, 0) << bad;
    EXPECT_NE(e.err.find("--trace-steps"), std::string::npos) << e.err;
  }
}

TEST(Outputs, UnwritableOutputsAreRefusedBeforeTraining) {
  for (const char* flag : {"--trace", "--profile", "--profile-phases"}) {
    const Outcome e = run_program(
        FERRY_CLI, std::string("train --model mlp --epochs 1 --train-limit 256 ") + flag + " /nonexistent/folder/out");
    EXPECT_NE(e.status, 0) << flag;
    EXPECT_NE(e.err.find(std::string("ferry: error: ") + flag + " /nonexistent/folder/out"), std::string::npos)
        << e.err;
    EXPECT_EQ(e.err.find("epoch 1/1"), std::string::npos) << flag << ": training ran first:\n" << e.err;
  }
}

TEST(Outputs, GptJson) {
  const char* text = std::getenv("FERRY_TEXT_DIR");
  if (!fs::is_directory(text ? text : "/usr/share/games/fortunes")) GTEST_SKIP() << "no fortunes text to train on";
  const Outcome r = run_program(FERRY_CLI,
                                "train --model gpt --steps 2 --eval-every 1 --width 32 --depth 1 --heads 2 "
                                "--context 16 --batch 2 --sample 5 --json --quiet");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_EQ(r.lines[0].at("schema"), 1);
  EXPECT_NE(r.out.find("\"lr\":0.002,"), std::string::npos) << r.out;
  expect_documented(r.lines[0], "ferry train --model gpt");
}

// ferry checkpoint describes a file ferry train wrote: what it was trained with and how far.
TEST(Outputs, CheckpointJson) {
  const fs::path d = scratch();
  const std::string file = (d / "run.ckpt").string();
  const Outcome train = run_program(FERRY_CLI,
                                    "train --model mlp --epochs 1 --train-limit 512 --quiet "
                                    "--weight-decay 0.01 --checkpoint '" +
                                        file + "'");
  ASSERT_EQ(train.status, 0) << train.err;
  const Outcome r = run_program(FERRY_CLI, "checkpoint '" + file + "' --json");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u) << r.out;
  const json& j = r.lines[0];
  expect_documented(j, "ferry checkpoint");
  EXPECT_GE(j.at("format_version").get<int>(), 2);
  EXPECT_EQ(j.at("optimizer_updates"), 2);
  EXPECT_EQ(j.at("caller_kind"), "ferry train");
  std::map<std::string, std::string> settings;
  for (const auto& s : j.at("settings")) settings[s.at("flag").get<std::string>()] = s.at("value").get<std::string>();
  EXPECT_EQ(settings["--weight-decay"], "0.01");
  EXPECT_EQ(settings["--precision"], "fp32");
  std::uint64_t bytes = 0;
  for (const auto& t : j.at("tensors")) bytes += t.at("bytes").get<std::uint64_t>();
  EXPECT_EQ(bytes, j.at("tensor_bytes").get<std::uint64_t>());
  const Outcome text = run_program(FERRY_CLI, "checkpoint '" + file + "'");
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("--weight-decay 0.01"), std::string::npos) << text.out;
  const Outcome missing = run_program(FERRY_CLI, "checkpoint '" + (d / "none.ckpt").string() + "'");
  EXPECT_EQ(missing.status, 1);
  EXPECT_NE(missing.err.find("cannot open checkpoint"), std::string::npos) << missing.err;
}

TEST(Outputs, PlanAndVersion) {
  const Outcome r = run_program(FERRY_CLI, "plan --model deep --width 64 --depth 2 --device-budget 64MiB --json");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_EQ(r.lines[0].at("schema"), 1);
  expect_documented(r.lines[0], "ferry plan");
  for (const char* program : {FERRY_CLI, FERRY_BENCH}) {
    const Outcome v = run_program(program, "--version");
    EXPECT_EQ(v.status, 0) << v.err;
    EXPECT_NE(v.out.find(" (git "), std::string::npos) << v.out;
    EXPECT_NE(v.out.find("OpenCL devices"), std::string::npos) << v.out;
  }
}

// The step bench's work figure for the MLP (784-1024-1024-10) at `batch`: every layer's forward
// product and weight gradient, and the input gradients of all but the first layer, 2 M N K each.
void expect_mlp_step_work(const std::vector<json>& lines, std::uint64_t batch) {
  const std::uint64_t forward = 2 * batch * (784 * 1024 + 1024 * 1024 + 1024 * 10);
  const std::uint64_t input_gradients = 2 * batch * (1024 * 1024 + 1024 * 10);
  const double want = static_cast<double>(2 * forward + input_gradients) / 1e9;
  const auto ferry =
      std::find_if(lines.begin(), lines.end(), [](const json& j) { return j.value("impl", "") == "ferry"; });
  ASSERT_NE(ferry, lines.end());
  EXPECT_DOUBLE_EQ(ferry->value("step_gflop", 0.0), want) << ferry->dump();
  EXPECT_DOUBLE_EQ(ferry->value("gflops", 0.0), want * 1e3 / ferry->value("step_ms", 0.0)) << ferry->dump();
}

TEST(Outputs, BenchmarksDocumentEveryKey) {
  const fs::path d = scratch();
  const std::vector<std::pair<std::string, std::string>> benches = {
      {"launch", "launch -n 20 --elems 1024 --repeat 1"},
      {"staging", "staging --bytes 1MiB --chunks 256KiB --repeat 1"},
      {"allreduce", "allreduce --hidden 32 --batch 8 --steps 2 --max-ranks 4"},
      {"graph", "graph --sizes 16 --runs 2 --repeat 1"},
      {"peak", "peak --widths 4 --accumulators 4 --run-ms 2 --repeat 1"},
      {"hostpath", "hostpath --layers 4 --width 8 --steps 3 --warmup 1 --repeat 1"},
      {"compile", "compile --depth 2 --depth 4 --width 16 --repeat 1"},
      {"gemm", "gemm --sizes 64 --repeat 1 --breakdown"},
      {"gemm", "gemm --sizes 64 --repeat 2 --cold --impls ferry openblas"},
      {"gemm", "gemm --sizes 64 --repeat 1 --rounds 3 --impls ferry openblas"},
      {"overlap",
       "overlap --repeat 1 --link-bytes 1MiB --config name=small,model=mlp,width=256,depth=1,batch=8,"
       "budget=4MiB --config name=toosmall,model=mlp,width=256,depth=1,batch=8,budget=4KiB --trace '" +
           (d / "overlap.json").string() + "'"},
      // Staged host memory adds host-lane unpack / pack nodes, which are not the link's bytes.
      {"overlap",
       "overlap --repeat 1 --host-memory staged --no-mapped --link-bytes 1MiB --config "
       "name=staged,model=mlp,width=256,depth=1,batch=8,budget=4MiB"},
      {"state", "state --width 64 --depth 2 --batch 8 --warmup 1 --steps 1 --device-budget 1MiB"},
      {"step", "step --batch 16 --warmup 1 --steps 2 --repeat 1 --python /nonexistent/python3"},
      {"gpt",
       "gpt --width 16 --depth 1 --heads 2 --context 16 --batch 2 --warmup 1 --steps 1 --repeat 1 --python "
       "/nonexistent/python3"},
      {"attention", "attention --contexts 32 --heads 2 --head-dim 16 --repeat 1 --peer --python /nonexistent/python3"},
      {"conv", "conv --batch 2 --gemm-n 64 --repeat 1 --breakdown"},
      {"compress", "compress --steps 2 --batch 16 --inner 5 --repeat 1"},
      {"phases", "phases --epochs 1 --train-limit 512 --stream-steps 2 --repeat 1"},
      {"host-optimizer", "host-optimizer --elements 4097 --threads 1 --repeat 1 --peer --python /nonexistent/python3"},
  };
  for (const auto& [name, args] : benches) {
    const Outcome r = run_program(FERRY_BENCH, args);
    EXPECT_FALSE(r.lines.empty()) << name << ": " << r.err;
    for (const json& j : r.lines) {
      EXPECT_EQ(j.value("schema", 0), 1) << name << ": " << j.dump();
      expect_documented(j, "ferry-bench " + name);
    }
    for (const json& j : r.lines) {
      if (j.contains("timeline_bytes_match_plan")) {
        EXPECT_TRUE(j["timeline_bytes_match_plan"].get<bool>()) << "the timeline's link bytes: " << j.dump();
      }
    }
    if (name == "overlap" && args.find("--trace") != std::string::npos) {
      EXPECT_NE(r.err.find("wrote a trace of 3 streamed steps (1 of 2 configurations)"), std::string::npos) << r.err;
      EXPECT_FALSE(json::parse(slurp(d / "overlap.json"), nullptr, false).is_discarded());
    }
    if (name == "step") expect_mlp_step_work(r.lines, 16);
    // Ratios round by round: one a round, their median the line's ratio (where OpenBLAS is built in:
    // it has a line of its own).
    const bool openblas =
        std::any_of(r.lines.begin(), r.lines.end(), [](const json& j) { return j.value("impl", "") == "openblas"; });
    for (const json& j : r.lines) {
      if (args.find("--rounds 3") == std::string::npos || !openblas || j.value("impl", "") != "ferry") continue;
      ASSERT_TRUE(j.contains("ratio_vs_openblas_rounds")) << j.dump();
      std::vector<double> each = j["ratio_vs_openblas_rounds"].get<std::vector<double>>();
      ASSERT_EQ(each.size(), 3u) << j.dump();
      std::sort(each.begin(), each.end());
      EXPECT_DOUBLE_EQ(j.value("ratio_vs_openblas", 0.0), each[1]) << j.dump();
      EXPECT_EQ(j.value("rounds", 0), 3) << j.dump();
    }
  }
}

// ferry-bench refuses values that a run would misread (NaN, a wrapped negative, 0 read as "no
// limit"), before any measuring, saying which option and what to give.
TEST(Outputs, BenchRefusesBadArguments) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"peak --run-ms nan", "--run-ms: must be a finite number > 0, got nan"},
      {"peak --widths 4,4", "--widths: 4 is given twice"},
      {"overlap --config slack=-1", "slack=-1: slack must be a whole number from 1 to 65536"},
      {"overlap --config slack=99999999999", "slack must be a whole number from 1 to 65536"},
      {"overlap --config width=-128", "width must be a whole number from 1 to 65536"},
      {"overlap --config budget=0", "--config budget=0: a budget must be more than 0 bytes"},
      {"compile --device-budget 0", "--device-budget 0: a budget must be more than 0 bytes"},
      {"state --device-budget 0", "--device-budget 0: a budget must be more than 0 bytes"},
      {"phases --device-budget 0", "--device-budget 0: a budget must be more than 0 bytes"},
      {"phases --batch 0", "--batch: must be a finite number > 0, got 0"},
      {"compress --seed -1", "--seed: must be a whole number >= 0, got -1"},
      {"state --level 50", "zstd level 50 is outside"},  // before the first, uncompressed, run
      {"staging --chunks 1", "--chunks: 1.0 B is not between the smallest staging chunk, 4.0 KiB"},
      {"gemm --shape 16777216,16777216,1 --impls ferry", "more than half of this machine's"},
      {"gemm --sizes abc", "--sizes: must be a whole number >= 0, got abc"},
      {"gpt --lr abc", "--lr: must be a finite number > 0, got abc"},
      {"gpt --lr ''", "--lr: must be a finite number > 0, got"},
  };
  for (const auto& [args, message] : refused) {
    const Outcome r = run_program(FERRY_BENCH, args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_TRUE(r.lines.empty()) << args << ": " << r.out;
    EXPECT_NE(r.err.find(message), std::string::npos) << args << ": " << r.err;
  }
  // One launch writes buffer b only: its check reads b.
  const Outcome one = run_program(FERRY_BENCH, "launch -n 1 --repeat 1");
  EXPECT_EQ(one.status, 0) << one.err;
  // A --python that exists but cannot be run is not called missing.
  const Outcome passwd = run_program(
      FERRY_BENCH, "attention --contexts 32 --heads 2 --head-dim 16 --repeat 1 --peer --python /etc/passwd");
  ASSERT_FALSE(passwd.lines.empty()) << passwd.err;
  EXPECT_EQ(passwd.lines[0].value("peer_error", ""),
            "interpreter not usable: /etc/passwd is not executable (give one with torch: --python)");
}

#else
TEST(Outputs, NeedsTheProgramsBuilt) {
  GTEST_SKIP() << "ferry and ferry-bench are not part of this build";
}
#endif

}  // namespace
