// Why protobuf refused a request's bytes, said precisely: bytes that are not a protobuf
// encoding at all (truncated, a wrong wire type, garbage) versus a well-formed message
// whose text field is not valid UTF-8 (which proto3 refuses), naming the field. The check
// parses the bytes again into a twin of the message type whose text fields are bytes, so
// it runs only for requests already refused.
#pragma once

#include <string>
#include <string_view>

namespace google::protobuf {
class Descriptor;
}

namespace m3 {

// "its bytes are not a valid protobuf encoding of m3serve.v1.GenerateRequest" or "its
// field prompt_text is not valid UTF-8 (protobuf requires text fields to be)".
std::string why_unparsable(std::string_view bytes, const google::protobuf::Descriptor& type);

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), as protobuf requires of text fields.
bool is_valid_utf8(std::string_view text);

}  // namespace m3
