package pgoutboxui

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A payload read by its start is shown as what it is: a binary one with
// every byte read, a text one cut inside a character still as text, and
// a start that fits the preview marked as going on.
func TestPayloadStartsAreShownForWhatTheyAre(t *testing.T) {
	bin := []byte{0xff, 0x00, 0xe4, 0xb8} // ends like a cut character
	v := viewPayload(bin, 1000)
	require.Equal(t, "binary", v.Kind)
	require.Contains(t, v.Hex, "ff 00 e4 b8", "every byte read is shown")
	require.Contains(t, v.Base64, "(cut: 1000 bytes in all)")
	require.Equal(t, 1000, v.Size)

	text := []byte("héllo \xc3") // é's first byte, cut
	v = viewPayload(text, 500)
	require.Equal(t, "text", v.Kind)
	require.Equal(t, "héllo \n… (cut: 500 bytes in all)", v.Text)
	require.Equal(t, "héllo…", preview(text, 500))
	require.Equal(t, "héllo", preview([]byte("héllo"), 5), "whole")
	require.Equal(t, "(500 bytes of binary)", preview(bin, 500))

	long := strings.Repeat("a ", 100)
	require.Equal(t, strings.Repeat("a ", 39)+"a…", preview([]byte(long), 10_000))

	js := []byte(`{"a": 1}`)
	require.Equal(t, "json", viewPayload(js, len(js)).Kind)
	require.Equal(t, "text", viewPayload(js[:5], 100).Kind, "a JSON payload's start is not JSON")
	require.Equal(t, "empty", viewPayload(nil, 0).Kind)
}
