// specair-run --artifacts DIR --prompt-ids FILE.jsonl [--max-tokens N] [--temperature T --top-p P --top-k K
//             --seed S] [--ignore-eos] [--threads N] [--max-num-seqs N] [--json]
//             [--executor aoti|acl --om-dir DIR --device N]
//
// Mirrors `specair generate --prompt-ids`: one {"prompt_ids": [...]} per line in, one result per prompt out,
// in prompt order. Every line and every prompt is checked before the first graph runs, so bad input writes
// nothing.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include "runner.h"

using namespace specair;

namespace {

const char* kUsage =
    "usage: specair-run --artifacts DIR --prompt-ids FILE.jsonl [--max-tokens N] [--temperature T] [--top-p P] "
    "[--top-k K] [--seed S] [--ignore-eos] [--threads N] [--max-num-seqs N] [--json] [--executor aoti|acl] "
    "[--om-dir DIR] [--device N]";

struct Args {
  std::string artifacts, prompt_ids, executor = "aoti", om_dir;
  Params params;
  int threads = 0, device = 0;
  int64_t max_num_seqs = 1;
  bool json_out = false;
};

template <typename T>
T number(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    T v;
    if constexpr (std::is_floating_point_v<T>) {
      v = static_cast<T>(std::stod(text, &used));
    } else if constexpr (std::is_unsigned_v<T>) {
      if (!text.empty() && text[0] == '-') throw std::invalid_argument(text);
      v = static_cast<T>(std::stoull(text, &used));
    } else {
      v = static_cast<T>(std::stoll(text, &used));
    }
    if (used != text.size()) throw std::invalid_argument(text);
    return v;
  } catch (const std::exception&) {
    throw InputError("argument " + flag + ": invalid value '" + text + "'");
  }
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw InputError("argument " + flag + ": expected a value");
      return argv[++i];
    };
    if (flag == "--artifacts") a.artifacts = value();
    else if (flag == "--prompt-ids") a.prompt_ids = value();
    else if (flag == "--max-tokens") a.params.max_tokens = number<int64_t>(flag, value());
    else if (flag == "--temperature") a.params.temperature = number<double>(flag, value());
    else if (flag == "--top-p") a.params.top_p = number<double>(flag, value());
    else if (flag == "--top-k") a.params.top_k = number<int64_t>(flag, value());
    else if (flag == "--seed") a.params.seed = number<uint64_t>(flag, value());
    else if (flag == "--ignore-eos") a.params.ignore_eos = true;
    else if (flag == "--threads") a.threads = number<int>(flag, value());
    else if (flag == "--json") a.json_out = true;
    else if (flag == "--max-num-seqs") a.max_num_seqs = number<int64_t>(flag, value());
    else if (flag == "--executor") a.executor = value();
    else if (flag == "--om-dir") a.om_dir = value();
    else if (flag == "--device") a.device = number<int>(flag, value());
    else if (flag == "-h" || flag == "--help") {
      std::cout << kUsage << "\n";
      std::exit(0);
    } else {
      throw InputError("unrecognized argument " + flag);
    }
  }
  if (a.artifacts.empty() || a.prompt_ids.empty()) throw InputError("--artifacts and --prompt-ids are required");
  if (a.executor != "aoti" && a.executor != "acl") throw InputError("--executor must be aoti or acl");
  if (a.threads < 0) throw InputError("--threads must be positive");
  if (a.max_num_seqs < 1) throw InputError("--max-num-seqs must be positive");
  return a;
}

std::vector<std::vector<int64_t>> read_prompts(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InputError("cannot read prompts file " + path);
  std::vector<std::vector<int64_t>> prompts;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string where = path + ":" + std::to_string(n) + ": ";
    json rec;
    try {
      rec = json::parse(line);
    } catch (const json::exception&) {
      throw InputError(where + "not valid JSON");
    }
    if (!rec.is_object() || !rec.contains("prompt_ids") || !rec["prompt_ids"].is_array())
      throw InputError(where + "expected {\"prompt_ids\": [...]}");
    std::vector<int64_t> ids;
    for (const auto& t : rec["prompt_ids"]) {
      if (!t.is_number_integer()) throw InputError(where + "prompt_ids must be a list of integers");
      ids.push_back(t.get<int64_t>());
    }
    prompts.push_back(std::move(ids));
  }
  if (prompts.empty()) throw InputError(path + " holds no prompts");
  return prompts;
}

json to_json(const Result& r, const std::string& backend) {
  json j = {{"text", r.text},
            {"token_ids", r.token_ids},
            {"num_prompt_tokens", r.num_prompt_tokens},
            {"num_generated_tokens", r.token_ids.size()},
            {"finish_reason", r.finish_reason},
            {"ttft_s", r.ttft_s},
            {"decode_tokens_per_s", r.decode_tokens_per_s},
            {"prefill_tokens_per_s", r.prefill_tokens_per_s}};
  if (r.spec) {
    const SpecStats& s = *r.spec;
    j["spec"] = {{"num_drafts", s.drafts},
                 {"num_draft_tokens", s.draft_tokens},
                 {"num_accepted_tokens", s.accepted},
                 {"accepted_per_position", s.per_position},
                 {"mean_accepted_length", double(s.accepted + s.drafts) / std::max<int64_t>(s.drafts, 1)}};
  }
  j["backend"] = backend;
  j["runtime"] = "native";
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse(argc, argv);
    if (args.threads) at::set_num_threads(args.threads);
    Artifacts art = Artifacts::open(args.artifacts, args.executor == "acl" ? "onnx" : "aoti");
    auto prompts = read_prompts(args.prompt_ids);
    std::unique_ptr<Executor> exec;
    if (args.executor == "acl") {
#ifdef SPECAIR_WITH_ACL
      exec = acl_executor(art, args.om_dir.empty() ? art.dir : fs::path(args.om_dir), args.device);
#else
      throw InputError("--executor acl: this specair-run was built without a CANN toolkit (AscendCL)");
#endif
    } else {
      exec = aoti_executor(art);
    }
    if (args.max_num_seqs > art.batch_buckets.back())
      throw InputError("--max-num-seqs " + std::to_string(args.max_num_seqs) + " exceeds the largest compiled batch "
                       "bucket (" + std::to_string(art.batch_buckets.back()) + "); recompile with larger --buckets");
    Runner runner(art, *exec, args.max_num_seqs);
    for (const auto& p : prompts) runner.check(p, args.params);
    std::string backend = art.manifest.at("backend");
    // Results print in prompt order: each as soon as every earlier one has.
    std::vector<std::optional<Result>> done(prompts.size());
    size_t printed = 0;
    auto on_result = [&](size_t i, const Result& r) {
      done[i] = r;
      for (; printed < done.size() && done[printed]; ++printed) {
        const Result& x = *done[printed];
        if (args.json_out) {
          std::cout << to_json(x, backend).dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
          continue;
        }
        if (args.max_num_seqs > 1) std::cout << x.text;
        std::cout << std::endl;
        std::cerr << "[" << x.num_prompt_tokens << " prompt tokens, ttft " << int(x.ttft_s * 1000) << " ms | "
                  << x.token_ids.size() << " generated, " << x.decode_tokens_per_s << " tok/s decode";
        if (x.spec)
          std::cerr << " | " << double(x.spec->accepted + x.spec->drafts) / std::max<int64_t>(x.spec->drafts, 1)
                    << " tokens per target pass";
        std::cerr << " | finish: " << x.finish_reason << "]" << std::endl;
      }
    };
    std::function<void(size_t, const std::string&)> stream;  // text as it comes, one sequence at a time
    if (!args.json_out && args.max_num_seqs == 1)
      stream = [](size_t, const std::string& bytes) { std::cout << bytes << std::flush; };
    runner.generate(prompts, args.params, stream, on_result);
  } catch (const InputError& e) {
    std::cerr << "specair-run: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "specair-run: error: " << what.substr(0, what.find('\n')) << std::endl;
    return 1;
  }
  return 0;
}
