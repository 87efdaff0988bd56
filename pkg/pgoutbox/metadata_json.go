package pgoutbox

import (
	"encoding/json"
	"fmt"
	"maps"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata travels as a JSON object of strings: written by Publish, read
// back from jsonb by the subscriber. Both directions avoid encoding/json on
// the hot path; a drain profile showed it costing more than the rest of a
// delivery.

// instructions records which keys of a message's metadata the publisher
// must read (schedule, dedup key, ordering key), found while the metadata
// is encoded: the commonest message has none, and looking each up costs
// more than the encoding (BenchmarkPublisherOverhead).
type instructions uint8

const (
	hasDeliverAfter instructions = 1 << iota
	hasDeliverAt
	hasDelayedFor
	hasDelayedUntil
	hasDedupKey
	hasOrderingKey
)

// appendMetadataJSON appends md as a JSON object, leaving out the keys that
// are instructions to the publisher, after checking that every key and
// value can be stored as text; it reports which instruction keys it saw.
func appendMetadataJSON(buf []byte, i int, md message.Metadata) ([]byte, instructions, error) {
	var seen instructions
	buf = append(buf, '{')
	first := true
	for k, v := range md {
		if err := checkText(i, k, func() string { return fmt.Sprintf("metadata key %q", k) }); err != nil {
			return buf, seen, err
		}
		if err := checkText(i, v, func() string { return fmt.Sprintf("metadata value of %q", k) }); err != nil {
			return buf, seen, err
		}
		if len(k) > 0 && k[0] == '_' { // every instruction key starts so
			switch k {
			case deliverAfterKey:
				seen |= hasDeliverAfter
				continue
			case deliverAtKey:
				seen |= hasDeliverAt
				continue
			case dedupKeyKey:
				seen |= hasDedupKey
				continue
			case OrderingKeyMetadataKey:
				seen |= hasOrderingKey
				continue
			case delay.DelayedForKey: // Watermill's: read, and kept with the message
				seen |= hasDelayedFor
			case delay.DelayedUntilKey:
				seen |= hasDelayedUntil
			}
		}
		if !first {
			buf = append(buf, ',')
		}
		first = false
		buf = appendJSONString(buf, k)
		buf = append(buf, ':')
		buf = appendJSONString(buf, v)
	}
	return append(buf, '}'), seen, nil
}

// appendJSONString appends s, valid UTF-8 without NUL (checkText), as a JSON
// string: quotes, backslashes and control characters escaped.
func appendJSONString(buf []byte, s string) []byte {
	const hex = "0123456789abcdef"
	buf = append(buf, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		buf = append(buf, s[start:i]...)
		switch c {
		case '"', '\\':
			buf = append(buf, '\\', c)
		case '\n':
			buf = append(buf, '\\', 'n')
		case '\t':
			buf = append(buf, '\\', 't')
		case '\r':
			buf = append(buf, '\\', 'r')
		default:
			buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		start = i + 1
	}
	buf = append(buf, s[start:]...)
	return append(buf, '"')
}

// decodeMetadata fills md from the metadata column, as PostgreSQL prints
// jsonb: {"key": "value", ...}. Strings without escapes (nearly all) are
// read directly; anything else goes through encoding/json, which a profile
// of a drain showed costing more than the rest of a delivery.
func decodeMetadata(raw []byte, md message.Metadata) error {
	if fastMetadata(raw, md) {
		return nil
	}
	clear(md)
	var m map[string]string
	if err := json.Unmarshal(raw, &m); err != nil {
		return fmt.Errorf("metadata is not a JSON object of strings: %w", err)
	}
	if m == nil { // JSON null: not an object (Unmarshal accepts it)
		return fmt.Errorf("metadata is JSON null, not an object of strings")
	}
	maps.Copy(md, m)
	return nil
}

// fastMetadata parses raw when it is an object of escape-free strings, in
// jsonb's output layout; it reports false (leaving md to be cleared) for
// anything else.
func fastMetadata(raw []byte, md message.Metadata) bool {
	i := 0
	skip := func() {
		for i < len(raw) && (raw[i] == ' ' || raw[i] == '\n' || raw[i] == '\t' || raw[i] == '\r') {
			i++
		}
	}
	str := func() (string, bool) {
		if i >= len(raw) || raw[i] != '"' {
			return "", false
		}
		start := i + 1
		for j := start; j < len(raw); j++ {
			if raw[j] < 0x20 { // invalid in JSON: let encoding/json say so
				return "", false
			}
			switch raw[j] {
			case '\\':
				return "", false
			case '"':
				if !utf8.Valid(raw[start:j]) {
					return "", false
				}
				i = j + 1
				return string(raw[start:j]), true
			}
		}
		return "", false
	}
	skip()
	if i >= len(raw) || raw[i] != '{' {
		return false
	}
	i++
	skip()
	if i < len(raw) && raw[i] == '}' {
		i++
		skip()
		return i == len(raw)
	}
	for {
		skip()
		k, ok := str()
		if !ok {
			return false
		}
		skip()
		if i >= len(raw) || raw[i] != ':' {
			return false
		}
		i++
		skip()
		v, ok := str()
		if !ok {
			return false
		}
		md[k] = v
		skip()
		if i >= len(raw) {
			return false
		}
		switch raw[i] {
		case ',':
			i++
		case '}':
			i++
			skip()
			return i == len(raw)
		default:
			return false
		}
	}
}
