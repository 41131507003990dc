#include "server/unparsable_message.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/message.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace m3 {
namespace {

namespace pb = google::protobuf;

void text_fields_as_bytes(pb::DescriptorProto* message) {
  for (auto& field : *message->mutable_field())
    if (field.type() == pb::FieldDescriptorProto::TYPE_STRING) field.set_type(pb::FieldDescriptorProto::TYPE_BYTES);
  for (auto& nested : *message->mutable_nested_type()) text_fields_as_bytes(&nested);
}

// The message types of one .proto file with every text field made bytes (which takes any
// bytes), built once per file.
class BytesTwin {
 public:
  explicit BytesTwin(const pb::FileDescriptor& file) {
    pb::FileDescriptorProto proto;
    file.CopyTo(&proto);
    for (auto& message : *proto.mutable_message_type()) text_fields_as_bytes(&message);
    file_ = pool_.BuildFile(proto);
  }
  // null when the twin could not be built (the file imports another: not needed here).
  const pb::Message* prototype(const std::string& full_name) {
    if (file_ == nullptr) return nullptr;
    const pb::Descriptor* twin = pool_.FindMessageTypeByName(full_name);
    return twin ? factory_.GetPrototype(twin) : nullptr;
  }

 private:
  pb::DescriptorPool pool_;
  pb::DynamicMessageFactory factory_;
  const pb::FileDescriptor* file_ = nullptr;
};

// The first text field (by the original type) of `twin` that is not UTF-8, as a path
// ("config.session_id"); "" when all are.
std::string first_invalid_text(const pb::Message& twin, const pb::Descriptor& original, const std::string& prefix) {
  const pb::Reflection& reflection = *twin.GetReflection();
  std::vector<const pb::FieldDescriptor*> fields;
  reflection.ListFields(twin, &fields);
  for (const pb::FieldDescriptor* field : fields) {
    const pb::FieldDescriptor* as_declared = original.FindFieldByNumber(field->number());
    if (as_declared == nullptr) continue;
    const std::string path = prefix + field->name();
    if (as_declared->type() == pb::FieldDescriptor::TYPE_STRING) {
      if (field->is_repeated()) {
        for (int i = 0; i < reflection.FieldSize(twin, field); ++i)
          if (!is_valid_utf8(reflection.GetRepeatedString(twin, field, i))) return path + "[" + std::to_string(i) + "]";
      } else if (!is_valid_utf8(reflection.GetString(twin, field))) {
        return path;
      }
    } else if (as_declared->type() == pb::FieldDescriptor::TYPE_MESSAGE) {
      if (field->is_repeated()) {
        for (int i = 0; i < reflection.FieldSize(twin, field); ++i) {
          std::string found = first_invalid_text(reflection.GetRepeatedMessage(twin, field, i),
                                                 *as_declared->message_type(),
                                                 path + "[" + std::to_string(i) + "].");
          if (!found.empty()) return found;
        }
      } else {
        std::string found =
            first_invalid_text(reflection.GetMessage(twin, field), *as_declared->message_type(), path + ".");
        if (!found.empty()) return found;
      }
    }
  }
  return "";
}

}  // namespace

bool is_valid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    int more = 0;
    uint32_t code = 0;
    if ((lead & 0xE0) == 0xC0) {
      more = 1, code = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      more = 2, code = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      more = 3, code = lead & 0x07;
    } else {
      return false;
    }
    if (text.size() - i <= static_cast<size_t>(more)) return false;
    for (int k = 1; k <= more; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      code = (code << 6) | (next & 0x3F);
    }
    static constexpr uint32_t kSmallest[] = {0, 0x80, 0x800, 0x10000};
    if (code < kSmallest[more] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    i += more + 1;
  }
  return true;
}

std::string why_unparsable(std::string_view bytes, const pb::Descriptor& type) {
  static std::mutex mu;
  static std::map<const pb::FileDescriptor*, std::unique_ptr<BytesTwin>> twins;
  std::unique_ptr<pb::Message> twin;
  {
    std::lock_guard lock(mu);
    auto& built = twins[type.file()];
    if (!built) built = std::make_unique<BytesTwin>(*type.file());
    if (const pb::Message* prototype = built->prototype(type.full_name())) twin.reset(prototype->New());
  }
  const std::string not_encoding = "its bytes are not a valid protobuf encoding of " + type.full_name();
  if (!twin) return not_encoding;
  if (!twin->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return not_encoding;
  const std::string field = first_invalid_text(*twin, type, "");
  if (field.empty()) return "protobuf refused it as " + type.full_name();
  return "its field " + field + " is not valid UTF-8 (protobuf requires text fields to be)";
}

}  // namespace m3
