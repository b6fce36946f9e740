package main

// The controller manager of this binary: the seven kube-controller-manager loops that a cluster without nodes
// still needs for the objects kvtier touches: Deployments make ReplicaSets (which make Pods that stay Pending:
// there is no kubelet), deleted namespaces empty out, owner references cascade, every namespace gets its
// "default" ServiceAccount and kube-root-ca.crt, and the aggregated ClusterRoles (admin/edit/view) are filled in.
// They are built from
// their own packages with the constructors and settings upstream's cmd/kube-controller-manager/app uses
// (apps.go, core.go, certificates.go, rbac.go, controllermanager.go at v1.37.2).
//
// Why not upstream's command: k8s.io/kubernetes/cmd/kube-controller-manager/app links every controller it knows
// (the scheduler framework for the DRA and volume-binding ones, every volume plugin, kubelet and cadvisor code,
// the cloud provider), about a third of the cold build's compile time, to run seven small loops.
// What is left out on purpose: leader election (one instance), the secure serving endpoint (nothing scrapes
// it), configz/healthz, and service-account credentials per controller (every loop uses the admin kubeconfig,
// as upstream does without --use-service-account-credentials).

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	cacheddiscovery "k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/informers"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/controller-manager/pkg/informerfactory"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/certificates/rootcacertpublisher"
	"k8s.io/kubernetes/pkg/controller/clusterroleaggregation"
	"k8s.io/kubernetes/pkg/controller/deployment"
	"k8s.io/kubernetes/pkg/controller/garbagecollector"
	"k8s.io/kubernetes/pkg/controller/namespace"
	"k8s.io/kubernetes/pkg/controller/replicaset"
	"k8s.io/kubernetes/pkg/controller/serviceaccount"
)

// Upstream's defaults (KubeControllerManagerConfiguration v1alpha1) for the settings these loops read.
const (
	minResyncPeriod           = 12 * time.Hour
	concurrentDeploymentSyncs = 5
	concurrentRSSyncs         = 5
	concurrentNamespaceSyncs  = 10
	namespaceSyncPeriod       = 5 * time.Minute
	kubeAPIQPS                = 20
	kubeAPIBurst              = 30
	concurrentGCSyncs         = 20
	gcSyncPeriod              = 30 * time.Second
	restMapperResetPeriod     = 30 * time.Second
	apiServerWait             = 10 * time.Second
)

func runControllerManager(args []string) int {
	fs := flag.NewFlagSet("kube-controller-manager", flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", "", "admin kubeconfig of the API server (required)")
	rootCAFile := fs.String("root-ca-file", "", "CA bundle published as kube-root-ca.crt in every namespace (required)")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.Var(klogFlags.Lookup("v").Value, "v", "log verbosity")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *kubeconfig == "" || *rootCAFile == "" {
		fmt.Fprintln(os.Stderr, "kvtier-controlplane kube-controller-manager: --kubeconfig and --root-ca-file are required")
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	ctx = klog.NewContext(ctx, klog.Background())
	if err := runControllers(ctx, *kubeconfig, *rootCAFile); err != nil {
		klog.ErrorS(err, "kube-controller-manager failed")
		klog.Flush()
		return 1
	}
	klog.Flush()
	return 0
}

// controllerLoop is one controller ready to run until its context ends.
type controllerLoop struct {
	name string
	run  func(ctx context.Context)
}

func runControllers(ctx context.Context, kubeconfigPath, rootCAFile string) error {
	logger := klog.FromContext(ctx)
	rootCA, err := os.ReadFile(rootCAFile)
	if err != nil {
		return fmt.Errorf("--root-ca-file: %w", err)
	}
	base, err := clientcmd.BuildConfigFromFlags("", kubeconfigPath)
	if err != nil {
		return fmt.Errorf("--kubeconfig: %w", err)
	}
	// kube-controller-manager's --kube-api-qps and --kube-api-burst defaults. A kubeconfig carries no rate, and
	// client-go's fallback (5 QPS) throttled the loops that scale it below: at 0 x 20 the namespace controller
	// fell back to 5 QPS, and emptying one namespace took 16 s on an idle server, minutes with many CRDs.
	base.QPS = kubeAPIQPS
	base.Burst = kubeAPIBurst
	// configFor gives each loop its own user agent, as upstream's client builder does, so the API server's
	// audit and metrics tell them apart.
	configFor := func(name string) *restclient.Config {
		return restclient.AddUserAgent(restclient.CopyConfig(base), "kube-controller-manager/"+name)
	}
	clientFor := func(name string) (clientset.Interface, error) { return clientset.NewForConfig(configFor(name)) }

	informerClient, err := clientFor("shared-informers")
	if err != nil {
		return err
	}
	if err := waitForAPIServer(ctx, informerClient, apiServerWait); err != nil {
		return err
	}
	resync := func() time.Duration { return time.Duration(float64(minResyncPeriod) * (rand.Float64() + 1)) }
	// Managed fields are never read by these loops; dropping them keeps the caches small, as upstream does.
	trim := func(obj any) (any, error) {
		if accessor, err := meta.Accessor(obj); err == nil && accessor.GetManagedFields() != nil {
			accessor.SetManagedFields(nil)
		}
		return obj, nil
	}
	shared := informers.NewSharedInformerFactoryWithOptions(informerClient, resync(), informers.WithTransform(trim))
	metadataInformerClient, err := metadata.NewForConfig(configFor("metadata-informers"))
	if err != nil {
		return err
	}
	metadataInformers := metadatainformer.NewSharedInformerFactoryWithOptions(metadataInformerClient, resync(),
		metadatainformer.WithTransform(trim))
	objectOrMetadata := informerfactory.NewInformerFactory(shared, metadataInformers)

	discoveryClient, err := discovery.NewDiscoveryClientForConfig(configFor("controller-discovery"))
	if err != nil {
		return err
	}
	restMapper := restmapper.NewDeferredDiscoveryRESTMapper(cacheddiscovery.NewMemCacheClient(discoveryClient))
	go wait.Until(restMapper.Reset, restMapperResetPeriod, ctx.Done())
	informersStarted := make(chan struct{})

	builders := []struct {
		name  string
		build func() (func(context.Context), error)
	}{
		{"deployment-controller", func() (func(context.Context), error) {
			client, err := clientFor("deployment-controller")
			if err != nil {
				return nil, err
			}
			dc, err := deployment.NewDeploymentController(ctx, shared.Apps().V1().Deployments(),
				shared.Apps().V1().ReplicaSets(), shared.Core().V1().Pods(), client)
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) { dc.Run(ctx, concurrentDeploymentSyncs) }, nil
		}},
		{"replicaset-controller", func() (func(context.Context), error) {
			client, err := clientFor("replicaset-controller")
			if err != nil {
				return nil, err
			}
			rsc := replicaset.NewReplicaSetController(ctx, shared.Apps().V1().ReplicaSets(), shared.Core().V1().Pods(),
				client, replicaset.BurstReplicas)
			return func(ctx context.Context) { rsc.Run(ctx, concurrentRSSyncs) }, nil
		}},
		{"namespace-controller", func() (func(context.Context), error) {
			// Upstream raises its limits this much: emptying a namespace is many discovery and delete calls.
			config := configFor("namespace-controller")
			config.QPS *= 20
			config.Burst *= 100
			client, err := clientset.NewForConfig(config)
			if err != nil {
				return nil, err
			}
			metadataClient, err := metadata.NewForConfig(config)
			if err != nil {
				return nil, err
			}
			nc := namespace.NewNamespaceController(ctx, client, metadataClient,
				client.Discovery().ServerPreferredNamespacedResources, shared.Core().V1().Namespaces(),
				namespaceSyncPeriod, v1.FinalizerKubernetes)
			return func(ctx context.Context) { nc.Run(ctx, concurrentNamespaceSyncs) }, nil
		}},
		{"garbage-collector-controller", func() (func(context.Context), error) {
			config := configFor("generic-garbage-collector")
			client, err := clientset.NewForConfig(config)
			if err != nil {
				return nil, err
			}
			gcDiscovery, err := discovery.NewDiscoveryClientForConfig(config)
			if err != nil {
				return nil, err
			}
			// Each deletion is two API calls; upstream doubles QPS to keep the deletion rate.
			metadataConfig := restclient.CopyConfig(config)
			metadataConfig.QPS *= 2
			metadataClient, err := metadata.NewForConfig(metadataConfig)
			if err != nil {
				return nil, err
			}
			graph := garbagecollector.NewDependencyGraphBuilder(ctx, metadataInformerClient, restMapper,
				garbagecollector.DefaultIgnoredResources(), objectOrMetadata, informersStarted)
			gc, err := garbagecollector.NewComposedGarbageCollector(ctx, client, metadataClient, restMapper, graph)
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) {
				var wg sync.WaitGroup
				wg.Go(func() { gc.Run(ctx, concurrentGCSyncs, gcSyncPeriod) })
				// Picks up resources (CRDs included) that appear later, refreshing the RESTMapper as it goes.
				wg.Go(func() { gc.Sync(ctx, gcDiscovery, gcSyncPeriod) })
				wg.Wait()
			}, nil
		}},
		{"serviceaccount-controller", func() (func(context.Context), error) {
			client, err := clientFor("service-account-controller")
			if err != nil {
				return nil, err
			}
			sac, err := serviceaccount.NewServiceAccountsController(logger, shared.Core().V1().ServiceAccounts(),
				shared.Core().V1().Namespaces(), client, serviceaccount.DefaultServiceAccountsControllerOptions())
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) { sac.Run(ctx, 1) }, nil
		}},
		{"root-ca-certificate-publisher-controller", func() (func(context.Context), error) {
			client, err := clientFor("root-ca-cert-publisher")
			if err != nil {
				return nil, err
			}
			p, err := rootcacertpublisher.NewPublisher(shared.Core().V1().ConfigMaps(), shared.Core().V1().Namespaces(),
				client, rootCA)
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) { p.Run(ctx, 1) }, nil
		}},
		{"clusterrole-aggregation-controller", func() (func(context.Context), error) {
			client, err := clientFor("clusterrole-aggregation-controller")
			if err != nil {
				return nil, err
			}
			crac := clusterroleaggregation.NewClusterRoleAggregation(shared.Rbac().V1().ClusterRoles(), client.RbacV1())
			return func(ctx context.Context) { crac.Run(ctx, 5) }, nil
		}},
	}
	var loops []controllerLoop
	for _, b := range builders {
		run, err := b.build()
		if err != nil {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		loops = append(loops, controllerLoop{name: b.name, run: run})
	}

	// As upstream: informers start once every loop has registered the ones it uses; the GC's monitors wait
	// for informersStarted before they start their own.
	shared.Start(ctx.Done())
	defer shared.Shutdown()
	objectOrMetadata.Start(ctx.Done())
	close(informersStarted)

	var wg sync.WaitGroup
	for _, l := range loops {
		logger.Info("Starting controller", "controller", l.name)
		wg.Go(func() { l.run(ctx) })
	}
	<-ctx.Done()
	logger.Info("Stopping controllers")
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		logger.Info("Controllers still stopping after 5s; exiting anyway")
	}
	return nil
}

// waitForAPIServer waits until /healthz answers ok, for when the controller manager starts with the API server.
func waitForAPIServer(ctx context.Context, client clientset.Interface, timeout time.Duration) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		result := client.Discovery().RESTClient().Get().AbsPath("/healthz").Do(ctx)
		var status int
		result.StatusCode(&status)
		if status == 200 {
			return true, nil
		}
		last = result.Error()
		return false, nil
	})
	if err != nil {
		return errors.Join(fmt.Errorf("API server not healthy after %s", timeout), last)
	}
	return nil
}
