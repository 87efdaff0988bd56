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

	// A parked row that ended meanwhile (its own batch failed) is dropped
	// when its earlier delivery is let go.
	ended, next := row(9, "k"), row(10, "")
	require.Same(t, sameKey, g.claimed(ended))
	ended.state = finished
	require.Nil(t, g.claimed(next))
	nextAgain := row(10, "")
	require.Same(t, next, g.claimed(nextAgain))
	require.Empty(t, g.letGo(sameKey), "the ended row is not handed out")
	require.Equal(t, map[*delivery]*delivery{nextAgain: next}, g.parked)

	// At a stop every parked row still ours goes back, oldest first.
	waiting1, waiting2 := row(21, ""), row(20, "")
	require.Nil(t, g.claimed(row(20, "")))
	require.Nil(t, g.claimed(row(21, "")))
	require.NotNil(t, g.claimed(waiting1))
	require.NotNil(t, g.claimed(waiting2))
	require.Equal(t, []*delivery{nextAgain, waiting2, waiting1}, g.takeParked())
	require.Empty(t, g.parked)
}
