package relay

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// With MaxInFlight 1 (exact order) the relay leases unless a claim mode was
// chosen: on the held path a lost connection gives a batch's acked rows
// back, and they reached the broker again after later messages.
func TestAnOrderedRelayLeases(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		inFlight int
		mode     pgoutbox.ClaimMode
		want     pgoutbox.ClaimMode
	}{
		{1, pgoutbox.ClaimAuto, pgoutbox.ClaimLease},
		{1, pgoutbox.ClaimHeld, pgoutbox.ClaimHeld},
		{0, pgoutbox.ClaimAuto, pgoutbox.ClaimAuto},
		{16, pgoutbox.ClaimAuto, pgoutbox.ClaimAuto},
	} {
		c := Config{Topics: []string{"t"}, Subscriber: pgoutbox.SubscriberConfig{MaxInFlight: tc.inFlight, ClaimMode: tc.mode}}
		require.NoError(t, c.setDefaults())
		require.Equal(t, tc.want, c.Subscriber.ClaimMode, "MaxInFlight %d, ClaimMode %v", tc.inFlight, tc.mode)
	}
}
