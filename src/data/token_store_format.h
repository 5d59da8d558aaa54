// token_store_format.h — the layout both the token store's reader and writer
// follow (Megatron-LM's indexed dataset, version 1): the index file's header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroshard::token_store_format {

inline constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr int64_t kHeaderBytes = 34;  // magic, u64 version, u8 type, u64 sequences, u64 documents + 1
inline constexpr size_t kChunk = size_t{1} << 20;  // what one read or copy moves

}  // namespace zeroshard::token_store_format
