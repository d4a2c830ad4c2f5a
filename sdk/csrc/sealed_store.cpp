// A job's view of its rendezvous store when it has a token: every key under the job's
// prefix, every value sealed (encrypted and authenticated) with a key derived from the
// token, so that a client without the token can neither read the job's values nor
// write one that the job accepts. The cipher is Rust's (`job_token.rs`), passed in as
// two functions; this class only maps c10d's Store interface onto it.
//
// The rule, for every operation: a value that fails to open (written by a client
// without the token, or moved from another key: the full key is the associated data)
// counts as absent. `get` and `wait` go on waiting for a value that opens, up to the
// timeout; `add`, `compareSet` and `append` replace it.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "internal.hpp"

namespace {

using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;

// How often `get` and `wait` look again at a key whose value did not open.
constexpr auto kRetry = std::chrono::milliseconds(20);

class SealedStore : public c10d::Store {
 public:
  SealedStore(
      std::string prefix, c10::intrusive_ptr<c10d::Store> base, const uint8_t* secret,
      size_t overhead, tdc_seal_fn seal, tdc_open_fn open)
      : prefix_(std::move(prefix)),
        base_(std::move(base)),
        secret_(secret, secret + TDC_SECRET_BYTES),
        overhead_(overhead),
        seal_(seal),
        open_(open) {
    timeout_ = base_->getTimeout();
  }

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<SealedStore>(
        prefix_, base_->clone(), secret_.data(), overhead_, seal_, open_);
  }

  void set(const std::string& key, const Bytes& value) override {
    auto full = join(key);
    base_->set(full, sealed(full, value));
  }

  Bytes get(const std::string& key) override {
    auto full = join(key);
    return opened_within(full, base_->getTimeout());
  }

  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired)
      override {
    auto written = update(join(key), [&](const std::optional<Bytes>& current) {
      bool matches = current ? *current == expected : expected.empty();
      return matches ? std::optional<Bytes>(desired) : std::nullopt;
    });
    return written.value_or(expected);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    auto full = join(key);
    auto now = update(full, [&](const std::optional<Bytes>& current) -> std::optional<Bytes> {
      if (delta == 0) return std::nullopt;  // a read: nothing written, nothing created
      auto text = std::to_string((current ? parse(full, *current) : 0) + delta);
      return Bytes(text.begin(), text.end());
    });
    return now ? parse(full, *now) : 0;
  }

  void append(const std::string& key, const Bytes& value) override {
    update(join(key), [&](const std::optional<Bytes>& current) {
      Bytes joined = current.value_or(Bytes());
      joined.insert(joined.end(), value.begin(), value.end());
      return std::optional<Bytes>(std::move(joined));
    });
  }

  bool deleteKey(const std::string& key) override {
    return base_->deleteKey(join(key));
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& key : keys) {
      if (!read(join(key)).second) return false;
    }
    return true;
  }

  int64_t getNumKeys() override {
    return base_->getNumKeys();
  }

  void wait(const std::vector<std::string>& keys) override {
    wait(keys, base_->getTimeout());
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout)
      override {
    auto deadline = Clock::now() + timeout;
    for (const auto& key : keys) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now());
      opened_within(join(key), std::max(left, std::chrono::milliseconds(1)));
    }
  }

  const std::chrono::milliseconds& getTimeout() const noexcept override {
    return base_->getTimeout();
  }

  void setTimeout(const std::chrono::milliseconds& timeout) override {
    base_->setTimeout(timeout);
    timeout_ = timeout;  // what Store's own helpers (2.13's `barrier`) read
  }

 private:
  std::string join(const std::string& key) const {
    return prefix_ + "/" + key;
  }

  Bytes sealed(const std::string& full, const Bytes& plain) const {
    Bytes out(plain.size() + overhead_);
    if (seal_(secret_.data(), full.c_str(), plain.data(), plain.size(), out.data()) != TDC_OK) {
      throw std::runtime_error("cannot seal the value of store key " + full);
    }
    return out;
  }

  std::optional<Bytes> opened(const std::string& full, const Bytes& raw) const {
    if (raw.size() < overhead_) return std::nullopt;
    Bytes out(raw.size() - overhead_);
    if (open_(secret_.data(), full.c_str(), raw.data(), raw.size(), out.data()) != TDC_OK) {
      return std::nullopt;
    }
    return out;
  }

  // The raw value at `full` (empty when absent) and what it opens to (none when
  // absent or not the job's).
  std::pair<Bytes, std::optional<Bytes>> read(const std::string& full) {
    if (!base_->check({full})) return {Bytes(), std::nullopt};
    auto raw = base_->get(full);
    auto plain = opened(full, raw);
    return {std::move(raw), std::move(plain)};
  }

  // Replaces the value at `full` with `next(current)` sealed, atomically (c10d's
  // compareSet against the raw value read, again while another writer comes first);
  // `current` is none when absent or not the job's. Returns what it wrote, or, when
  // `next` gives none, `current` (nothing written).
  template <typename Next>
  std::optional<Bytes> update(const std::string& full, Next next) {
    for (;;) {
      auto [raw, current] = read(full);
      std::optional<Bytes> plain = next(current);
      if (!plain) return current;
      auto desired = sealed(full, *plain);
      if (base_->compareSet(full, raw, desired) == desired) return plain;
    }
  }

  // Waits up to `timeout` for a value at `full` that opens.
  Bytes opened_within(const std::string& full, std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    base_->wait({full}, timeout);
    for (;;) {
      if (auto plain = opened(full, base_->get(full))) return *plain;
      if (Clock::now() >= deadline) {
        throw std::runtime_error(
            "the rendezvous store's value under " + full +
            " is not this job's: it failed authentication with the job's token "
            "(TCH_DISTRIBUTED_JOB_TOKEN) until the timeout (" +
            std::to_string(timeout.count()) +
            " ms). A client without the token wrote it, or a process of another job "
            "uses this store: keep the store's port reachable by the job's hosts only, "
            "and give every rank the same token");
      }
      std::this_thread::sleep_for(kRetry);
    }
  }

  static int64_t parse(const std::string& full, const Bytes& value) {
    try {
      return std::stoll(std::string(value.begin(), value.end()));
    } catch (const std::exception&) {
      throw std::runtime_error("the store's value under " + full + " is not a counter");
    }
  }

  std::string prefix_;
  c10::intrusive_ptr<c10d::Store> base_;
  Bytes secret_;
  size_t overhead_;
  tdc_seal_fn seal_;
  tdc_open_fn open_;
};

} // namespace

extern "C" tdc_store* tdc_sealed_store_new(
    const char* prefix, tdc_store* base, const uint8_t* secret, size_t overhead,
    tdc_seal_fn seal, tdc_open_fn open) {
  TDC_PROTECT(nullptr, {
    return new tdc_store{
        c10::make_intrusive<SealedStore>(prefix, base->store, secret, overhead, seal, open)};
  })
}
