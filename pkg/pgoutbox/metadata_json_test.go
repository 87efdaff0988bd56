package pgoutbox

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
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
