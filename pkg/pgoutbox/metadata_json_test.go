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
	buf, err := appendMetadataJSON(nil, 0, md)
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
		buf, err := appendMetadataJSON(nil, 0, message.Metadata{k: v})
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
