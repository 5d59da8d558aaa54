// store_file.h — a rank file in the durable tier, read where it is: the index written
// beside each rank file (where each dataset lies and the xxh3 of its bytes), and a
// reader that fetches only the datasets asked for, by ranged GETs, each verified.
#pragma once

#include "checksum.h"
#include "h5.h"
#include "s3_client.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::ckpt {

// The index of a rank file written beside it (`rank-*.h5.index`, JSON) when the
// checkpoint has a durable tier: where each dataset lies in the file and the xxh3
// of its bytes. Its own size and xxh3 are in the manifest's entry of the file.
nlohmann::json dataset_index(const std::string& file_name, const checkpoint::FileDigest& file,
                             const std::vector<checkpoint::h5::Extent>& extents);
std::filesystem::path index_path(const std::filesystem::path& rank_file);

// The rank file at `key` in the store (`entry`: its manifest entry, which names an index), read
// dataset by dataset: each dataset by one ranged GET when first read (neighbours share one),
// verified against the index (itself verified against the entry) before it is used. Throws
// naming the object when the index does not match. Logs what it read when destroyed.
std::unique_ptr<checkpoint::h5::Readable> open_store_file(s3::Client& client, std::string key,
                                                          const nlohmann::json& entry);

}  // namespace zeroshard::ckpt
