// A per-rank trace of a model's actors: with FLOWC_TRACE=FILE set, a generated model records on
// the device when each actor starts and ends, and writes one JSON line per actor per run:
//
//   {"run": 0, "rank": 0, "actor": 3, "name": "MatMul_2", "stream": 1, "start_us": 12.5, "end_us": 40.25}
//
// start_us/end_us are microseconds since the run's base event (cudaEventElapsedTime), which run()
// records on the caller's stream before anything else. A program of several ranks writes one file
// per rank: FILE with ".rank<R>" put before its extension (trace.jsonl -> trace.rank1.jsonl, as
// weights.bin -> weights.rank1.bin; no extension: trace -> trace.rank1). Without FLOWC_TRACE (or
// with it empty) every call below returns at once and no event is made. FILE may be a regular
// file, a character device (/dev/null) or a FIFO with a reader; a FIFO nobody reads, a
// directory or a block device is refused at open() (flowc/file_io.h), never waited on.
//
// How a generated model uses it (templates/model.cu.j2):
//
//   #include "flowc/trace.h"
//   // The schedule's actors, by id: their names and the stream each is issued on.
//   static const char* const kActorNames[kNumActors] = {"MatMul_2", ...};
//   static const int kActorStreams[kNumActors] = {0, 1, ...};
//
//   struct P_model { ...; flowc::trace::Recorder trace; };
//
//   P_create(), once the model's streams exist (a failure fails create with its message):
//     st = m->trace.open(kActorNames, kActorStreams, kNumActors, rank, /*multi_rank=*/mesh_size > 1);
//   P_run(), first, on the caller's stream, before any other stream is forked from it:
//     m->trace.begin_run(stream);
//   around each actor's launches, on the stream the actor is issued on:
//     m->trace.begin(7, streams[1]);  <actor 7's work>  m->trace.end(7, streams[1]);
//   P_synchronize(), after the wait for the run succeeded (a failure is the run's error):
//     st = m->trace.flush();
//   release(): m->trace.close();  (the destructor also closes)
//
// The events live on the model, so only the latest run queued before a synchronize can be read
// back: when several runs are queued and synchronized once, flush() writes the latest of them
// (its "run" field is its number among all runs begun, counting from 0) and the others are
// skipped. An actor that was not begun and ended in that run (a run that stopped early on an
// error) has no line. A run captured into a CUDA Graph records the events as graph nodes, so the
// same calls trace a graph launch. Lines are written in actor id order; the file is flushed after
// every run, so a trace survives a later crash.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "flowc/device.h"
#include "flowc/env.h"
#include "flowc/file_io.h"
#include "flowc/status.h"

namespace flowc {
namespace trace {

// FILE for rank R of a multi-rank program: ".rank<R>" before the extension of the last path
// component (a leading dot starts no extension: ".trace" -> ".trace.rank1").
inline std::string rank_path(const std::string& path, int rank) {
  const std::string part = ".rank" + std::to_string(rank);
  const size_t slash = path.find_last_of('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || dot <= base) return path + part;
  return path.substr(0, dot) + part + path.substr(dot);
}

// `s` as a JSON string literal, ASCII only: control and non-ASCII characters as \u escapes
// (surrogate pairs past U+FFFF), bytes that are not well-formed UTF-8 as U+FFFD, so the file
// parses whatever the model called its nodes.
inline std::string json_string(const char* s) {
  std::string out = "\"";
  const auto* p = reinterpret_cast<const unsigned char*>(s ? s : "");
  const size_t n = std::strlen(reinterpret_cast<const char*>(p));
  char buf[16];
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    long cp = 0xfffd;
    size_t len = 1;
    if (c < 0x80) {
      cp = c;
    } else if (c >= 0xc2 && c <= 0xf4) {
      const size_t need = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : 1;
      long v = c & (0x3f >> need);
      size_t k = 1;
      for (; k <= need && i + k < n && (p[i + k] & 0xc0) == 0x80; ++k) v = (v << 6) | (p[i + k] & 0x3f);
      static const long kMin[] = {0, 0x80, 0x800, 0x10000};
      if (k > need && v >= kMin[need] && v <= 0x10ffff && !(v >= 0xd800 && v <= 0xdfff)) {
        cp = v;
        len = need + 1;
      }
    }
    if (cp == '"' || cp == '\\') {
      out += '\\';
      out += char(cp);
    } else if (cp >= 0x20 && cp < 0x7f) {
      out += char(cp);
    } else if (cp < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04lx", cp);
      out += buf;
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04lx\\u%04lx", 0xd800 + ((cp - 0x10000) >> 10),
                    0xdc00 + ((cp - 0x10000) & 0x3ff));
      out += buf;
    }
    i += len;
  }
  return out + "\"";
}

namespace detail {

// Trace files open in this process, by path: two models linked into one program that trace to
// the same file share one handle (each truncating it would lose the other's lines).
struct OpenFile {
  std::FILE* f = nullptr;
  int users = 0;
};

inline std::map<std::string, OpenFile>& open_files() {
  static std::map<std::string, OpenFile> files;
  return files;
}

}  // namespace detail

class Recorder {
 public:
  Recorder() = default;
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;
  ~Recorder() { close(); }

  // At model create. Reads FLOWC_TRACE; when set, opens (truncates) the rank's file and makes
  // 2 * num_actors + 1 timing events. `names` and `streams` (the stream id of each actor) must
  // outlive the recorder; the generated tables are static.
  Status open(const char* const* names, const int* streams, int num_actors, int rank, bool multi_rank) {
    close();
    const char* env = env::path("FLOWC_TRACE");
    if (env == nullptr) return Status::Ok();
    if (num_actors < 0 || (num_actors > 0 && (names == nullptr || streams == nullptr))) {
      return InvalidArgument("trace: bad actor table");
    }
    path_ = multi_rank ? rank_path(env, rank) : std::string(env);
    detail::OpenFile& of = detail::open_files()[path_];
    if (of.f == nullptr) {
      io::File file;
      std::string why;
      if (io::open_for_writing(path_, false, &file, &why)) std::swap(of.f, file.f);
      if (of.f == nullptr) {
        detail::open_files().erase(path_);
        return InvalidArgument("FLOWC_TRACE=" + std::string(env) + ": cannot open " + path_ +
                               " for writing: " + why + " (unset FLOWC_TRACE or give a writable path)");
      }
    }
    ++of.users;
    file_ = of.f;
    names_ = names;
    streams_ = streams;
    rank_ = rank;
    events_.assign(2 * size_t(num_actors) + 1, nullptr);
    for (cudaEvent_t& e : events_) {
      const cudaError_t err = cudaEventCreate(&e);
      if (err != cudaSuccess) {
        e = nullptr;
        close();
        return LibraryError(std::string("trace: creating timing events failed: ") + cudaGetErrorString(err));
      }
    }
    begun_.assign(size_t(num_actors), 0);
    ended_.assign(size_t(num_actors), 0);
    on_ = true;
    return Status::Ok();
  }

  bool enabled() const { return on_; }

  // A run begins: its base event, on the caller's stream.
  void begin_run(cudaStream_t stream) {
    if (!on_) return;
    std::fill(begun_.begin(), begun_.end(), 0);
    std::fill(ended_.begin(), ended_.end(), 0);
    run_ = next_run_++;
    pending_ = cudaEventRecord(events_[0], stream) == cudaSuccess;
  }

  // Actor `actor` starts (begin) or ends (end) its work on `stream`, the stream it is issued on.
  void begin(int actor, cudaStream_t stream) {
    if (!on_ || !pending_ || actor < 0 || size_t(actor) >= begun_.size()) return;
    begun_[size_t(actor)] = cudaEventRecord(events_[1 + 2 * size_t(actor)], stream) == cudaSuccess;
  }
  void end(int actor, cudaStream_t stream) {
    if (!on_ || !pending_ || actor < 0 || size_t(actor) >= ended_.size()) return;
    ended_[size_t(actor)] = cudaEventRecord(events_[2 + 2 * size_t(actor)], stream) == cudaSuccess;
  }

  // After the run has finished (the model's synchronize): writes its lines. A second flush of
  // the same run writes nothing.
  Status flush() {
    if (!on_ || !pending_) return Status::Ok();
    pending_ = false;
    std::string lines;
    char buf[160];
    for (size_t a = 0; a < begun_.size(); ++a) {
      if (!begun_[a] || !ended_[a]) continue;
      float start_ms = 0, end_ms = 0;
      cudaError_t e = cudaEventElapsedTime(&start_ms, events_[0], events_[1 + 2 * a]);
      if (e == cudaSuccess) e = cudaEventElapsedTime(&end_ms, events_[0], events_[2 + 2 * a]);
      if (e != cudaSuccess) {
        return LibraryError(std::string("trace: reading actor ") + std::to_string(a) +
                            "'s events failed (was the run synchronized?): " + cudaGetErrorString(e));
      }
      std::snprintf(buf, sizeof buf, "{\"run\": %lld, \"rank\": %d, \"actor\": %zu, \"name\": ", run_, rank_,
                    a);
      lines += buf;
      lines += json_string(names_[a]);
      std::snprintf(buf, sizeof buf, ", \"stream\": %d, \"start_us\": %.3f, \"end_us\": %.3f}\n", streams_[a],
                    double(start_ms) * 1e3, double(end_ms) * 1e3);
      lines += buf;
    }
    if (std::fwrite(lines.data(), 1, lines.size(), file_) != lines.size() || std::fflush(file_) != 0) {
      return LibraryError("trace: writing " + path_ + " failed: " + std::strerror(errno));
    }
    return Status::Ok();
  }

  // Destroys the events and lets go of the file (closed when no other recorder uses it).
  void close() {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    events_.clear();
    if (file_ != nullptr) {
      auto it = detail::open_files().find(path_);
      if (it != detail::open_files().end() && --it->second.users == 0) {
        std::fclose(it->second.f);
        detail::open_files().erase(it);
      }
    }
    file_ = nullptr;
    on_ = false;
    pending_ = false;
  }

 private:
  bool on_ = false;
  bool pending_ = false;  // a run has begun and is not written yet
  std::FILE* file_ = nullptr;
  std::string path_;
  const char* const* names_ = nullptr;
  const int* streams_ = nullptr;
  int rank_ = 0;
  long long run_ = 0, next_run_ = 0;
  // events_[0]: the run's base; events_[1 + 2a] and events_[2 + 2a]: actor a's begin and end.
  std::vector<cudaEvent_t> events_;
  std::vector<char> begun_, ended_;
};

}  // namespace trace
}  // namespace flowc
