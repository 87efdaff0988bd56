package pgoutbox

import (
	"errors"
	"fmt"
)

// ErrPayloadTooLarge is returned by Publish for a message whose payload
// exceeds PublisherConfig.MaxPayloadBytes; nothing of the call is written.
// It also matches ErrInvalidMessage.
var ErrPayloadTooLarge = errors.New("pgoutbox: payload too large")

func payloadTooLarge(i, size, limit int) error {
	return errorf("%w: %w: message %d: payload is %d bytes, over PublisherConfig.MaxPayloadBytes (%d); store large bodies elsewhere (object storage) and publish a reference, or raise MaxPayloadBytes (NoPayloadLimit, -1, turns the check off)",
		ErrInvalidMessage, ErrPayloadTooLarge, i, size, limit)
}

func maxPayloadProblem(v int) string {
	return fmt.Sprintf("MaxPayloadBytes is %d; use a positive number of bytes, 0 for the default (%d), or NoPayloadLimit (-1) to disable the check", v, DefaultMaxPayloadBytes)
}
