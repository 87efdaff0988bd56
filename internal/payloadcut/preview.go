// Package payloadcut helps the operator views show payloads read by prefix
// (pgoutbox.PeekPayloadPrefix, DeadLetterFilter.PayloadPrefix).
package payloadcut

import "unicode/utf8"

// Trim returns p, the start of a payload of size bytes, without the
// first bytes of a character the cut split, so that the start of a text
// payload stays valid text. A whole payload (len(p) >= size) is returned
// as it is.
func Trim(p []byte, size int) []byte {
	if len(p) >= size {
		return p
	}
	for i := 0; i < utf8.UTFMax-1 && len(p) > 0; i++ {
		if r, n := utf8.DecodeLastRune(p); r != utf8.RuneError || n > 1 {
			break
		}
		p = p[:len(p)-1]
	}
	return p
}
