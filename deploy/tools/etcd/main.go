// Command etcd is etcd's own server main (go.etcd.io/etcd/server/v3/etcdmain), built from the
// Go module proxy so the manifest tests can run a real kube-apiserver against it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
