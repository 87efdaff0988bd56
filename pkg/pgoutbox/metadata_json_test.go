package pgoutbox

import (
	"encoding/json"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"
)

func TestMetadataJSONRoundTrips(t *testing.T) {
	t.Parallel()
	md := message.Metadata{
		"plain":           "value",
		"quote\"d":        `a "quoted" \ backslash`,
		"control":         "tab\tnewline\nreturn\rbell\x07unit\x1f",
		"unicode":         "żółw 🐢 \u2028",
		"":                "empty key",
		"empty":           "",
		deliverAfterKey:   "1s", // instructions are not stored
		dedupKeyKey:       "k",
		"html <b>&</b>":   "<script>",
		"_watermill_x":    "kept",
		"correlation_id":  "c-1",
		"reason_poisoned": "handler: \"x\" failed\n",
	}
	buf, _, err := appendMetadataJSON(nil, 0, md)
	require.NoError(t, err)
	var back map[string]string
	require.NoError(t, json.Unmarshal(buf, &back), string(buf))
	want := map[string]string{}
	for k, v := range md {
		if k != deliverAfterKey && k != dedupKeyKey {
			want[k] = v
		}
	}
	require.Equal(t, want, back)
}

func FuzzMetadataJSON(f *testing.F) {
	f.Add("k", "v")
	f.Add("\"", "\\\x00\x1f")
	f.Fuzz(func(t *testing.T, k, v string) {
		buf, _, err := appendMetadataJSON(nil, 0, message.Metadata{k: v})
		if !utf8.ValidString(k) || !utf8.ValidString(v) || containsNUL(k) || containsNUL(v) {
			require.Error(t, err)
			return
		}
		require.NoError(t, err)
		var back map[string]string
		require.NoError(t, json.Unmarshal(buf, &back), string(buf))
		if k == deliverAfterKey || k == deliverAtKey || k == dedupKeyKey {
			require.Empty(t, back)
			return
		}
		require.Equal(t, map[string]string{k: v}, back)
	})
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}

func TestDecodeMetadata(t *testing.T) {
	t.Parallel()
	cases := map[string]map[string]string{
		`{}`:                           {},
		` { } `:                        {},
		`{"a": "b"}`:                   {"a": "b"},
		`{"a": "b", "c": ""}`:          {"a": "b", "c": ""},
		`{"q": "say \"hi\"\n"}`:        {"q": "say \"hi\"\n"}, // escapes: the encoding/json path
		`{"u": "\u017c\u00f3\u0142w"}`: {"u": "żółw"},
		`{"emoji": "🐢"}`:               {"emoji": "🐢"},
	}
	for raw, want := range cases {
		md := message.Metadata{}
		require.NoError(t, decodeMetadata([]byte(raw), md), raw)
		require.Equal(t, message.Metadata(want), md, raw)
	}
	// JSON null is not an object: a row holding it is poisoned, not
	// delivered with empty metadata.
	for _, bad := range []string{`null`, ` null `, `{"n": 1}`, `[]`, `{"a": "b"`, `{"a" "b"}`, `{"a": "b"} x`, `{"a": {"b": "c"}}`} {
		md := message.Metadata{}
		require.Error(t, decodeMetadata([]byte(bad), md), bad)
	}
}

func FuzzDecodeMetadataAgreesWithEncodingJSON(f *testing.F) {
	f.Add([]byte(`{"a": "b", "c": "d"}`))
	f.Add([]byte(`{"a": "b\"c"}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		md := message.Metadata{}
		err := decodeMetadata(raw, md)
		var want map[string]string
		wantErr := json.Unmarshal(raw, &want)
		if wantErr != nil || want == nil {
			require.Error(t, err, "%q", raw) // JSON null included: not an object
			return
		}
		require.NoError(t, err, "%q", raw)
		require.Equal(t, message.Metadata(want), md, "%q", raw)
	})
}

// One Publish call encodes every message's metadata into one buffer and
// slices it: each message must get its own object, whatever lies between
// (no metadata, only instructions), and the instructions must be read
// from what the encoding saw.
func TestPublishArgsSlicesEachMessagesMetadata(t *testing.T) {
	t.Parallel()
	msg := func(md message.Metadata) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("p"))
		m.Metadata = md
		return m
	}
	msgs := []*message.Message{
		msg(message.Metadata{"a": "1"}),
		msg(nil),
		msg(message.Metadata{dedupKeyKey: "k"}), // only an instruction: stored as {}
		msg(message.Metadata{"b": "2", deliverAfterKey: "1m"}),
		msg(message.Metadata{delay.DelayedForKey: "2s", delay.DelayedUntilKey: "2030-01-01T00:00:00Z"}), // Watermill's: kept, and read
		msg(message.Metadata{OrderingKeyMetadataKey: "o", "c": "3"}),
		msg(message.Metadata{delay.DelayedForKey: "3s"}), // a copy of a redelivery's: kept, not an instruction
	}
	b, err := publishArgs("t", msgs, nil, NoPayloadLimit)
	require.NoError(t, err)
	require.Equal(t, []string{`{"a":"1"}`, `{}`, `{}`, `{"b":"2"}`}, b.metadata[:4])
	require.JSONEq(t, `{"_watermill_delayed_for":"2s","_watermill_delayed_until":"2030-01-01T00:00:00Z"}`, b.metadata[4])
	require.Equal(t, []string{`{"c":"3"}`, `{"_watermill_delayed_for":"3s"}`}, b.metadata[5:])
	require.NotNil(t, b.delays, "scheduled and keyed messages take the full statement")
	require.Equal(t, pgtype.Text{String: "k", Valid: true}, b.dedup[2])
	require.Equal(t, pgtype.Int8{Int64: time.Minute.Microseconds(), Valid: true}, b.delays[3])
	require.Equal(t, pgtype.Int8{Int64: (2 * time.Second).Microseconds(), Valid: true}, b.delays[4])
	require.Equal(t, pgtype.Text{String: "o", Valid: true}, b.ordering[5])
	require.True(t, b.scheduled)
	for _, i := range []int{0, 1, 6} {
		require.False(t, b.delays[i].Valid || b.dedup[i].Valid || b.ordering[i].Valid, "message %d has no instruction", i)
	}

	plain, err := publishArgs("t", msgs[:2], nil, NoPayloadLimit)
	require.NoError(t, err)
	require.Nil(t, plain.delays, "without instructions the plain statement's arrays suffice")
}
