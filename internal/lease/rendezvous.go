package lease

import (
	"slices"

	"github.com/cespare/xxhash/v2"
)

// TargetOwner returns the member that should own item: the one with the
// highest weight xxhash64(member, 0x00, item) (rendezvous, or highest random
// weight, hashing). Every member computes the same answer from the same
// member list, in any order, and adding or removing one of N members moves
// only the items it gains or loses, about 1/N of them. Ties, practically
// impossible, go to the smaller member ID. It returns "" if members is
// empty.
func TargetOwner(members []string, item string) string {
	var best string
	var bestWeight uint64
	for i, m := range members {
		w := weight(m, item)
		if i == 0 || w > bestWeight || w == bestWeight && m < best {
			best, bestWeight = m, w
		}
	}
	return best
}

func weight(member, item string) uint64 {
	d := xxhash.New()
	_, _ = d.WriteString(member)
	_, _ = d.Write([]byte{0})
	_, _ = d.WriteString(item)
	return d.Sum64()
}

// Assign gives every item an owner among members by rendezvous hashing with
// bounded load: each member owns at most ceil(len(items)/len(members))
// items. Plain rendezvous hashing spreads items only as evenly as chance
// does: with 12 items and 3 members, one member gets 7 or more (or 1 or
// fewer) for about a quarter of member names. Here an item whose first
// choice is full goes to its next choice in rendezvous order.
//
// The result is the item-optimal stable matching between items (preferring
// members by TargetOwner's weights) and members (preferring items by the
// same weights), computed by deferred acceptance. It is unique, so it does
// not depend on the order of members or items, and every member computes
// the same assignment from the same lists. When the member set changes by
// one, few items move beyond those plain rendezvous hashing moves (the
// tests measure it). Duplicate names are ignored. It returns an empty map if
// members is empty.
func Assign(members, items []string) map[string]string {
	members = sortedUnique(members)
	items = sortedUnique(items)
	out := make(map[string]string, len(items))
	if len(members) == 0 {
		return out
	}
	capacity := (len(items) + len(members) - 1) / len(members)

	// prefs[i] lists member indexes in item i's order of preference.
	w := make([][]uint64, len(items)) // w[i][m]
	prefs := make([][]int, len(items))
	for i, it := range items {
		w[i] = make([]uint64, len(members))
		prefs[i] = make([]int, len(members))
		for m, mem := range members {
			w[i][m] = weight(mem, it)
			prefs[i][m] = m
		}
		slices.SortFunc(prefs[i], func(a, b int) int { return cmpWeight(w[i][b], members[b], w[i][a], members[a]) })
	}

	next := make([]int, len(items))     // next preference each item proposes to
	held := make([][]int, len(members)) // items each member holds
	free := make([]int, len(items))
	for i := range free {
		free[i] = i
	}
	for len(free) > 0 {
		i := free[len(free)-1]
		free = free[:len(free)-1]
		m := prefs[i][next[i]]
		next[i]++
		held[m] = append(held[m], i)
		if len(held[m]) <= capacity {
			continue
		}
		// Over capacity: reject the held item this member likes least.
		worst := 0
		for k, j := range held[m] {
			if cmpWeight(w[j][m], items[j], w[held[m][worst]][m], items[held[m][worst]]) < 0 {
				worst = k
			}
		}
		free = append(free, held[m][worst])
		held[m] = slices.Delete(held[m], worst, worst+1)
	}
	for m, is := range held {
		for _, i := range is {
			out[items[i]] = members[m]
		}
	}
	return out
}

// cmpWeight orders (weight, name) pairs: by weight, ties broken by the
// smaller name winning.
func cmpWeight(wa uint64, a string, wb uint64, b string) int {
	switch {
	case wa < wb:
		return -1
	case wa > wb:
		return 1
	case a > b:
		return -1
	case a < b:
		return 1
	}
	return 0
}

func sortedUnique(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return slices.Compact(s)
}
