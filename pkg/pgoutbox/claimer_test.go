package pgoutbox

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A claim's deliveries are distinct and zeroed, and cost one allocation
// per deliverySlabSize rows.
func TestDeliverySlabAllocatesOncePerArray(t *testing.T) {
	var slab deliverySlab
	ids := map[*delivery]int64{}
	for i := range 3 * deliverySlabSize {
		d := slab.next()
		_, again := ids[d]
		require.False(t, again, "delivery %d handed out twice", i)
		require.Equal(t, delivery{}, *d, "a fresh delivery is zero")
		d.id = int64(i + 1)
		ids[d] = d.id
	}
	for d, id := range ids {
		require.Equal(t, id, d.id, "a later next left it alone")
	}

	var fresh deliverySlab
	allocs := testing.AllocsPerRun(10, func() {
		fresh = deliverySlab{}
		for range deliverySlabSize {
			fresh.next()
		}
	})
	require.Equal(t, 1.0, allocs, "one array for %d deliveries", deliverySlabSize)
}
