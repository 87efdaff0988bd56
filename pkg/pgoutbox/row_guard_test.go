package pgoutbox

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRowGuardParksARowClaimedAgainUntilItsEarlierDeliveryIsLetGo(t *testing.T) {
	g := newRowGuard()
	row := func(id int64, key string) *delivery {
		d := &delivery{}
		d.id, d.orderingKey = id, key
		return d
	}
	first, other := row(7, "k"), row(8, "")
	require.Nil(t, g.claimed(first))
	require.Nil(t, g.claimed(other))

	again := row(7, "k") // its held batch's transaction died: claimed again
	require.Same(t, first, g.claimed(again), "the same row waits for its earlier delivery")
	sameKey := row(9, "k")
	require.Same(t, first, g.claimed(sameKey), "a row of the same key waits too")

	require.Empty(t, g.letGo(other), "nothing waits for another row")
	free := g.letGo(first)
	require.Equal(t, []*delivery{again}, free, "the row goes out first; its key's next row waits for it")
	require.Equal(t, map[*delivery]*delivery{sameKey: again}, g.parked)

	require.Equal(t, []*delivery{sameKey}, g.letGo(again))
	require.Empty(t, g.parked)
	require.Equal(t, map[int64]*delivery{9: sameKey}, g.byID)

	// A parked row that ended meanwhile (its own batch failed) is dropped,
	// and at a stop every parked row goes back, oldest first.
	ended, waiting1, waiting2 := row(9, "k"), row(21, ""), row(20, "")
	require.Same(t, sameKey, g.claimed(ended))
	ended.state = finished
	require.Nil(t, g.claimed(row(20, "")))
	require.Nil(t, g.claimed(row(21, "")))
	require.NotNil(t, g.claimed(waiting1))
	require.NotNil(t, g.claimed(waiting2))
	require.Equal(t, []*delivery{waiting2, waiting1}, g.takeParked())
	require.Empty(t, g.parked)
	require.Empty(t, g.letGo(sameKey), "the ended row is not handed out")
}
